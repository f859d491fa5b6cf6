package node

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"
)

// SSHConfig configures the real SSH client. Zero durations mean the
// defaults.
type SSHConfig struct {
	// Signer authenticates this agent (its bootstrap key). Required.
	Signer ssh.Signer
	// DialTimeout bounds each TCP connect. Default 10s.
	DialTimeout time.Duration
	// HandshakeTimeout bounds the SSH handshake (key exchange, host key
	// check, authentication) of each attempt. Default 15s.
	HandshakeTimeout time.Duration
	// ConnectTimeout bounds Connect as a whole: a host that is still
	// booting refuses connections for a while, and is tried again until
	// then. Default 90s.
	ConnectTimeout time.Duration
	// CommandTimeout bounds each command that sets none. Default 2m.
	CommandTimeout time.Duration
	// KeepAliveInterval is how often the watchdog checks that the host
	// answers; KeepAliveTimeout how long it waits for an answer before it
	// closes the connection (failing what runs). Defaults 5s and 15s.
	KeepAliveInterval time.Duration
	KeepAliveTimeout  time.Duration
}

// DefaultSSHConfig returns the defaults (Signer still required).
func DefaultSSHConfig() SSHConfig {
	return SSHConfig{
		DialTimeout: 10 * time.Second, HandshakeTimeout: 15 * time.Second, ConnectTimeout: 90 * time.Second,
		CommandTimeout: 2 * time.Minute, KeepAliveInterval: 5 * time.Second, KeepAliveTimeout: 15 * time.Second,
	}
}

func (c *SSHConfig) fill() error {
	if c.Signer == nil {
		return errors.New("ssh config: Signer is required")
	}
	d := DefaultSSHConfig()
	for _, f := range []struct{ v, def *time.Duration }{
		{&c.DialTimeout, &d.DialTimeout}, {&c.HandshakeTimeout, &d.HandshakeTimeout}, {&c.ConnectTimeout, &d.ConnectTimeout},
		{&c.CommandTimeout, &d.CommandTimeout}, {&c.KeepAliveInterval, &d.KeepAliveInterval}, {&c.KeepAliveTimeout, &d.KeepAliveTimeout},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	return nil
}

// ErrAuthFailed: the host refused this agent's key.
var ErrAuthFailed = errors.New("the host refused this agent's ssh key")

// SSHClients makes real SSH clients: a ClientFactory.
type SSHClients struct{ cfg SSHConfig }

var _ ClientFactory = (*SSHClients)(nil)

// NewSSHClients validates cfg and returns the factory.
func NewSSHClients(cfg SSHConfig) (*SSHClients, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	return &SSHClients{cfg: cfg}, nil
}

// ClientFor returns a new, unconnected client.
func (f *SSHClients) ClientFor(SessionSpec) Client { return NewSSHClient(f.cfg) }

// SSHClient is a Client over golang.org/x/crypto/ssh. The host key is
// always verified against the endpoint's pins, during key exchange, before
// authentication; every dial, handshake and command has a deadline; a
// keep-alive watchdog closes a connection whose host stops answering; and
// cancelling a command's context closes the connection.
type SSHClient struct {
	cfg SSHConfig

	mu     sync.Mutex
	client *ssh.Client
	closed bool
	reason error // why the connection was closed under us
	done   chan struct{}
	wg     sync.WaitGroup
}

var _ Client = (*SSHClient)(nil)

// NewSSHClient returns an unconnected client; cfg must have a Signer.
func NewSSHClient(cfg SSHConfig) *SSHClient {
	_ = cfg.fill()
	return &SSHClient{cfg: cfg, done: make(chan struct{})}
}

// hostKeyPins turns an endpoint's pins into a callback and the host key
// algorithms to offer (the pinned keys' own, so that a host with several
// keys presents a pinned one).
func hostKeyPins(ep Endpoint) (ssh.HostKeyCallback, []string, error) {
	var keys []ssh.PublicKey
	var algos []string
	for _, s := range ep.HostKeys {
		k, err := ParseAuthorizedKey(s)
		if err != nil {
			return nil, nil, fmt.Errorf("pinned host key: %w", err)
		}
		keys = append(keys, k)
		for _, a := range algosFor(k.Type()) {
			if !slices.Contains(algos, a) {
				algos = append(algos, a)
			}
		}
	}
	var fps []string
	for _, f := range ep.Fingerprints {
		n, err := NormalizeFingerprint(f)
		if err != nil {
			return nil, nil, err
		}
		fps = append(fps, n)
	}
	if len(keys) == 0 && len(fps) == 0 {
		return nil, nil, fmt.Errorf("%s: no host key pinned", ep.Addr())
	}
	if len(fps) > 0 {
		// A fingerprint does not say its key type: prefer the strongest
		// common ones, ed25519 first.
		for _, a := range []string{ssh.KeyAlgoED25519, ssh.KeyAlgoECDSA256, ssh.KeyAlgoECDSA384, ssh.KeyAlgoECDSA521, ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256} {
			if !slices.Contains(algos, a) {
				algos = append(algos, a)
			}
		}
	}
	cb := func(hostname string, remote net.Addr, key ssh.PublicKey) error {
		for _, k := range keys {
			if bytes.Equal(k.Marshal(), key.Marshal()) {
				return nil
			}
		}
		got := ssh.FingerprintSHA256(key)
		for _, f := range fps {
			if f == got {
				return nil
			}
		}
		want := append([]string(nil), fps...)
		for _, k := range keys {
			want = append(want, ssh.FingerprintSHA256(k))
		}
		return fmt.Errorf("%w: %s presented %s %s, pinned: %s", ErrHostKeyMismatch, hostname, key.Type(), got, strings.Join(want, ", "))
	}
	return cb, algos, nil
}

func algosFor(keyType string) []string {
	if keyType == ssh.KeyAlgoRSA {
		return []string{ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA}
	}
	return []string{keyType}
}

// permanent reports whether a connect error cannot be fixed by trying
// again: a wrong host key or a refused key.
func permanent(err error) bool {
	return errors.Is(err, ErrHostKeyMismatch) || errors.Is(err, ErrAuthFailed)
}

// ConnectRetry is an attempt of Connect that failed and will be made
// again: the operator sees a dial that keeps failing as it happens.
type ConnectRetry struct {
	Attempt int           // from 1
	Err     error         // why this attempt failed
	Next    time.Duration // the wait before the next one
}

func (r ConnectRetry) String() string {
	return fmt.Sprintf("attempt %d failed: %s; next in %s", r.Attempt, attemptCause(r.Err), r.Next.Round(10*time.Millisecond))
}

// ConnectError is a Connect that gave up: the failure stage it ends the
// session at, and why.
type ConnectError struct {
	Addr string
	// Stage is StageHostKeyMismatch, StageSSHAuthFailed,
	// StageSSHUnreachable (no TCP connection) or StageSSHTimeout
	// (connected, but no SSH session within the deadlines).
	Stage    Stage
	Attempts int
	Elapsed  time.Duration
	// Err is the last attempt's error (a cancelled one's predecessor).
	Err error
}

func (e *ConnectError) Error() string {
	switch e.Stage {
	case StageHostKeyMismatch, StageSSHAuthFailed:
		return e.Err.Error()
	case StageSSHUnreachable:
		return fmt.Sprintf("%s: %s, %d attempt(s) in %s (is sshd listening there?)", e.Addr, attemptCause(e.Err), e.Attempts, e.Elapsed.Round(time.Second))
	}
	return fmt.Sprintf("%s: no SSH session: %s, %d attempt(s) in %s", e.Addr, attemptCause(e.Err), e.Attempts, e.Elapsed.Round(time.Second))
}

func (e *ConnectError) Unwrap() error { return e.Err }

// dialError is a TCP connect that failed: no SSH was spoken.
type dialError struct{ err error }

func (e dialError) Error() string { return e.err.Error() }
func (e dialError) Unwrap() error { return e.err }

// handshakeError is a TCP connection on which no SSH session came about
// (a key mismatch and a refused key aside).
type handshakeError struct{ err error }

func (e handshakeError) Error() string { return "ssh handshake: " + e.err.Error() }
func (e handshakeError) Unwrap() error { return e.err }

// attemptCause is an attempt's error in the fewest words: "connection
// refused", not "dial tcp 10.0.0.7:22: connect: connection refused" (the
// address is named once, by the caller).
func attemptCause(err error) string {
	var he handshakeError
	if errors.As(err, &he) {
		return "ssh handshake: " + netCause(he.err)
	}
	return netCause(err)
}

func netCause(err error) string {
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Err != nil {
		var se *os.SyscallError
		if errors.As(oe.Err, &se) {
			return se.Err.Error()
		}
		return oe.Err.Error()
	}
	return err.Error()
}

// Connect dials ep until its sshd answers (or ConnectTimeout passes),
// verifying the host key before authenticating. A host key mismatch or a
// refused key ends it at once. retry (nil: none) is told of every failed
// attempt that is made again. A Connect that gives up returns a
// *ConnectError naming its stage.
func (c *SSHClient) Connect(ctx context.Context, ep Endpoint, retry func(ConnectRetry)) error {
	cb, algos, err := hostKeyPins(ep)
	if err != nil {
		return err
	}
	conf := &ssh.ClientConfig{
		User:              ep.User,
		Auth:              []ssh.AuthMethod{ssh.PublicKeys(c.cfg.Signer)},
		HostKeyCallback:   cb,
		HostKeyAlgorithms: algos,
		Timeout:           c.cfg.DialTimeout,
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, c.cfg.ConnectTimeout)
	defer cancel()
	backoff := 200 * time.Millisecond
	var last error
	for attempt := 1; ; attempt++ {
		cl, err := c.dial(ctx, ep, conf)
		if err == nil {
			return c.adopt(cl)
		}
		gaveUp := func(err error) error {
			if ctx.Err() != nil && last != nil {
				err = last // cut short by the deadline: the one before says why
			}
			ce := &ConnectError{Addr: ep.Addr(), Stage: StageSSHTimeout, Attempts: attempt, Elapsed: time.Since(start), Err: err}
			var de dialError
			switch {
			case errors.Is(err, ErrHostKeyMismatch):
				ce.Stage = StageHostKeyMismatch
			case errors.Is(err, ErrAuthFailed):
				ce.Stage = StageSSHAuthFailed
			case errors.As(err, &de):
				ce.Stage = StageSSHUnreachable
			}
			return ce
		}
		if permanent(err) || ctx.Err() != nil {
			return gaveUp(err)
		}
		last = err
		if deadline, _ := ctx.Deadline(); time.Until(deadline) <= backoff {
			// No attempt fits before the deadline: none is announced.
			<-ctx.Done()
			return gaveUp(err)
		}
		if retry != nil {
			retry(ConnectRetry{Attempt: attempt, Err: err, Next: backoff})
		}
		select {
		case <-ctx.Done():
			return gaveUp(err)
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

func (c *SSHClient) dial(ctx context.Context, ep Endpoint, conf *ssh.ClientConfig) (*ssh.Client, error) {
	d := net.Dialer{Timeout: c.cfg.DialTimeout}
	conn, err := d.DialContext(ctx, "tcp", ep.Addr())
	if err != nil {
		return nil, dialError{err}
	}
	// The handshake's deadline; and ctx ending closes the socket.
	_ = conn.SetDeadline(time.Now().Add(c.cfg.HandshakeTimeout))
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	sc, chans, reqs, err := ssh.NewClientConn(conn, ep.Addr(), conf)
	stop()
	if err != nil {
		conn.Close()
		if strings.Contains(err.Error(), "unable to authenticate") {
			pub := AuthorizedKey(c.cfg.Signer.PublicKey())
			return nil, fmt.Errorf("%w: %s as %s (authorize it there: %s)", ErrAuthFailed, ep.Addr(), ep.User, pub)
		}
		if errors.Is(err, ErrHostKeyMismatch) {
			return nil, hostKeyErr(err)
		}
		return nil, handshakeError{err}
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(sc, chans, reqs), nil
}

// hostKeyErr unwraps x/crypto/ssh's "ssh: handshake failed: " from the
// host key callback's own error, which says it all.
func hostKeyErr(err error) error {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if strings.HasPrefix(e.Error(), ErrHostKeyMismatch.Error()) {
			return e
		}
	}
	return err
}

func (c *SSHClient) adopt(cl *ssh.Client) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		cl.Close()
		return errors.New("ssh client closed")
	}
	if c.client != nil {
		cl.Close()
		return errors.New("ssh client already connected")
	}
	c.client = cl
	c.wg.Add(1)
	go c.watchdog(cl)
	return nil
}

// watchdog asks the host for a keep-alive answer every interval, and
// closes the connection when none comes within the timeout.
func (c *SSHClient) watchdog(cl *ssh.Client) {
	defer c.wg.Done()
	t := time.NewTicker(c.cfg.KeepAliveInterval)
	defer t.Stop()
	for {
		select {
		case <-c.done:
			return
		case <-t.C:
		}
		reply := make(chan error, 1)
		go func() {
			// OpenSSH answers with a failure: any answer is alive.
			_, _, err := cl.SendRequest("keepalive@openssh.com", true, nil)
			reply <- err
		}()
		timer := time.NewTimer(c.cfg.KeepAliveTimeout)
		select {
		case <-c.done:
			timer.Stop()
			return
		case err := <-reply:
			timer.Stop()
			if err != nil {
				c.closeWith(fmt.Errorf("keep-alive: %w", err))
				return
			}
		case <-timer.C:
			c.closeWith(fmt.Errorf("keep-alive: no answer within %v", c.cfg.KeepAliveTimeout))
			return
		}
	}
}

func (c *SSHClient) current() (*ssh.Client, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.reason != nil:
		return nil, fmt.Errorf("connection closed: %w", c.reason)
	case c.closed:
		return nil, errors.New("connection closed")
	case c.client == nil:
		return nil, errors.New("not connected")
	}
	return c.client, nil
}

// Run runs rc and returns its exit code. It calls rc.Stdout and rc.Stderr
// one line at a time (never concurrently) and returns only once both
// streams ended. A context that ends (cancelled, or the command's
// deadline) closes the connection.
func (c *SSHClient) Run(ctx context.Context, rc RemoteCommand) (int, error) {
	cl, err := c.current()
	if err != nil {
		return -1, err
	}
	timeout := rc.Timeout
	if timeout <= 0 {
		timeout = c.cfg.CommandTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { c.closeWith(fmt.Errorf("command %.60q: %w", rc.Line, context.Cause(ctx))) })
	defer stop()

	sess, err := cl.NewSession()
	if err != nil {
		return -1, c.explain(ctx, fmt.Errorf("new session: %w", err))
	}
	defer sess.Close()
	if rc.Stdin != nil {
		sess.Stdin = rc.Stdin
	}
	stdout, err := sess.StdoutPipe()
	if err != nil {
		return -1, err
	}
	stderr, err := sess.StderrPipe()
	if err != nil {
		return -1, err
	}
	var lineMu sync.Mutex
	var wg sync.WaitGroup
	for _, s := range []struct {
		r  io.Reader
		fn func(string)
	}{{stdout, rc.Stdout}, {stderr, rc.Stderr}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(s.r)
			sc.Buffer(make([]byte, 0, 4096), 1<<20)
			for sc.Scan() {
				if s.fn != nil {
					lineMu.Lock()
					s.fn(sc.Text())
					lineMu.Unlock()
				}
			}
			_, _ = io.Copy(io.Discard, s.r) // a line over 1 MiB: drain the rest
		}()
	}
	if err := sess.Start(rc.Line); err != nil {
		return -1, c.explain(ctx, fmt.Errorf("start %.60q: %w", rc.Line, err))
	}
	werr := sess.Wait()
	wg.Wait()
	var exit *ssh.ExitError
	switch {
	case werr == nil:
		return 0, nil
	case errors.As(werr, &exit):
		return exit.ExitStatus(), nil
	default:
		return -1, c.explain(ctx, fmt.Errorf("%.60q: %w", rc.Line, werr))
	}
}

// explain prefers the reason the connection was closed under us (keep-alive,
// deadline, cancel) to the error it caused.
func (c *SSHClient) explain(ctx context.Context, err error) error {
	c.mu.Lock()
	reason := c.reason
	c.mu.Unlock()
	if reason != nil {
		return fmt.Errorf("connection closed: %w", reason)
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %w", context.Cause(ctx), err)
	}
	return err
}

// closeWith closes the connection for reason, without waiting for the
// watchdog (which may be the caller).
func (c *SSHClient) closeWith(reason error) {
	c.mu.Lock()
	if c.reason == nil && !c.closed {
		c.reason = reason
	}
	c.mu.Unlock()
	_ = c.shutdown()
}

func (c *SSHClient) shutdown() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.done)
	cl := c.client
	c.mu.Unlock()
	if cl != nil {
		return cl.Close()
	}
	return nil
}

// Close closes the connection (whatever runs fails) and waits for the
// watchdog to stop. Idempotent.
func (c *SSHClient) Close() error {
	err := c.shutdown()
	c.wg.Wait()
	return err
}

// LoadOrCreateSigner returns the SSH key at path (OpenSSH format), making
// a new ed25519 key there (mode 0600) when there is none: the agent's
// bootstrap key, which hosts authorize so the agent may install nodes.
func LoadOrCreateSigner(path, comment string) (ssh.Signer, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		st, err := os.Stat(path)
		if err != nil {
			return nil, err
		}
		if st.Mode().Perm()&0o077 != 0 {
			return nil, fmt.Errorf("%s: mode %04o, want 0600 (no group or other access)", path, st.Mode().Perm())
		}
		s, err := ssh.ParsePrivateKey(b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return s, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	block, err := ssh.MarshalPrivateKey(key, comment)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return LoadOrCreateSigner(path, comment) // made meanwhile: use it
		}
		return nil, err
	}
	if _, err := f.Write(pem.EncodeToMemory(block)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return nil, err
	}
	return ssh.NewSignerFromKey(key)
}
