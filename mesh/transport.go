package mesh

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
)

// AuditQUICRefused is the kind of a refused transport peer in OnRefused
// consumers' audit logs.
const AuditQUICRefused = "mesh.quic.refused"

// Errors callers act on.
var (
	// ErrTransportClosed is returned by RoundTrip and Serve after Close.
	ErrTransportClosed = errors.New("mesh transport closed")
	// ErrUnknownPeer is wrapped by RoundTrip when the target node is not
	// admitted or has no QUIC address: nothing was sent.
	ErrUnknownPeer = errors.New("peer not admitted or without a QUIC address")
)

// Transport is the agent-to-agent HTTP/3 transport over QUIC. One UDP socket
// serves peers (Serve) and dials them (RoundTrip); one connection per peer
// is kept and reused. Both sides present a self-signed certificate of their
// node key and pin the other's key to an admitted node (client certificates
// are required); there are no session tickets and no 0-RTT.
//
// quic-go wants UDP socket buffers of about 7 MB; the sysctl drop-in
// configs/60-infermesh-quic.conf raises the kernel limits (net.core.rmem_max,
// net.core.wmem_max) so it can.
//
// All methods are safe for concurrent use.
type Transport struct {
	cfg TransportConfig
	log *zap.Logger
	dir PeerDirectory

	pc    net.PacketConn
	ownPC bool
	qt    *quic.Transport
	h3    *http3.Transport
	srv   *http3.Server

	cert       tls.Certificate
	clientTLS  *tls.Config
	clientQUIC *quic.Config
	serverQUIC *quic.Config

	mu      sync.Mutex
	dialed  map[string]*dialedConn   // node -> the connection we dialed
	heard   map[string]*heardFrom    // node -> when its answers last brought data
	served  map[*quic.Conn]*verified // connections peers dialed to us
	load    map[string]*peerLoad     // node -> its connections and requests here
	ln      *quic.Listener
	serving bool
	closed  bool
	closing chan struct{}

	refusals  refusals
	closeOnce sync.Once
	closeErr  error
}

// dialedConn is a connection we dialed, with what it was verified against.
type dialedConn struct {
	conn *quic.Conn
	node string
	addr string
	key  ed25519.PublicKey
}

// verified is the identity a connection was verified as in its handshake,
// and what its node holds here across its connections.
type verified struct {
	node string
	key  ed25519.PublicKey
	load *peerLoad
}

type peerCtxKey struct{}

// NewTransport binds the UDP socket (unless cfg.PacketConn is given) and
// returns a Transport that can dial peers at once; call Serve to accept
// theirs. Close releases everything.
func NewTransport(cfg TransportConfig) (*Transport, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("mesh transport config: %w", err)
	}
	cert, err := NodeCertificate(cfg.Name, cfg.Key)
	if err != nil {
		return nil, fmt.Errorf("mesh transport: %w", err)
	}
	t := &Transport{
		cfg:     cfg,
		log:     cfg.Logger.With(zap.String("node", cfg.Name)),
		dir:     cfg.Peers,
		cert:    cert,
		dialed:  map[string]*dialedConn{},
		heard:   map[string]*heardFrom{},
		served:  map[*quic.Conn]*verified{},
		load:    map[string]*peerLoad{},
		closing: make(chan struct{}),
	}
	t.refusals.init()
	t.pc = cfg.PacketConn
	if t.pc == nil {
		ua, err := net.ResolveUDPAddr("udp", cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("mesh transport: Listen %q: %w", cfg.Listen, err)
		}
		uc, err := net.ListenUDP("udp", ua)
		if err != nil {
			return nil, fmt.Errorf("mesh transport: %w", err)
		}
		t.pc, t.ownPC = uc, true
	}
	t.qt = &quic.Transport{Conn: t.pc}

	common := quic.Config{
		HandshakeIdleTimeout: cfg.HandshakeTimeout,
		MaxIdleTimeout:       cfg.MaxIdleTimeout,
		KeepAlivePeriod:      cfg.KeepAlivePeriod,
		Allow0RTT:            false,
	}
	t.clientQUIC = common.Clone()
	t.clientQUIC.MaxIncomingStreams = -1 // peers never open request streams towards their client
	t.serverQUIC = common.Clone()
	t.serverQUIC.MaxIncomingStreams = cfg.MaxStreamsPerPeer

	t.clientTLS = baseTLSConfig(cert)
	t.clientTLS.ClientSessionCache = nil
	t.h3 = &http3.Transport{
		TLSClientConfig:        t.clientTLS,
		QUICConfig:             t.clientQUIC,
		Dial:                   t.dial,
		DisableCompression:     true,
		MaxResponseHeaderBytes: MaxHeadBytes,
	}
	t.srv = &http3.Server{
		Handler:        http.HandlerFunc(t.servePeer),
		MaxHeaderBytes: MaxHeadBytes,
		ConnContext:    t.connContext,
	}
	return t, nil
}

// Addr is the bound UDP address.
func (t *Transport) Addr() net.Addr { return t.pc.LocalAddr() }

// Serve accepts peers' connections and serves their requests with the
// configured Handler, and re-checks live connections against the directory,
// until ctx ends or Close is called; then it closes the transport and
// returns nil. It returns an error when the listener cannot start or fails.
// Serve may be called once.
func (t *Transport) Serve(ctx context.Context) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return ErrTransportClosed
	}
	if t.serving {
		t.mu.Unlock()
		return errors.New("mesh transport: Serve called twice")
	}
	t.serving = true
	ln, err := t.qt.Listen(t.serverTLSConfig(), t.serverQUIC)
	if err != nil {
		t.mu.Unlock()
		return fmt.Errorf("mesh transport: listen: %w", err)
	}
	t.ln = ln
	t.mu.Unlock()
	t.checkBuffers()
	t.log.Info("mesh transport serving", zap.String("addr", t.Addr().String()))

	errc := make(chan error, 1) // buffered: the server goroutine never blocks on exit
	go func() { errc <- t.srv.ServeListener(limitedListener{Listener: ln, t: t}) }()
	accepting := true
	wait := func() {
		if accepting {
			<-errc
		}
	}
	tick := time.NewTicker(t.cfg.RecheckInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			_ = t.Close()
			wait()
			return nil
		case <-t.closing:
			wait()
			return nil
		case err := <-errc:
			accepting = false
			if !errors.Is(err, http.ErrServerClosed) {
				_ = t.Close()
				return fmt.Errorf("mesh transport: serve: %w", err)
			}
			// Shutdown stopped accepting; requests in flight finish and
			// their connections are still re-checked until it closes us.
			errc = nil
		case <-tick.C:
			t.recheck()
		}
	}
}

// Shutdown stops accepting new requests from peers (GOAWAY) and waits for
// those in flight until ctx ends, then closes the transport.
func (t *Transport) Shutdown(ctx context.Context) error {
	err := t.srv.Shutdown(ctx)
	if cerr := t.Close(); err == nil {
		err = cerr
	}
	return err
}

// Close closes every connection (peers are told, with CONNECTION_CLOSE),
// stops serving and releases the socket when the transport bound it. Idempotent.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		close(t.closing)
		ln := t.ln
		t.mu.Unlock()
		var errs []error
		// The server first: it tells its peers and waits for its handlers.
		if err := t.srv.Close(); err != nil {
			errs = append(errs, fmt.Errorf("server: %w", err))
		}
		if ln != nil {
			_ = ln.Close()
		}
		if err := t.h3.Close(); err != nil {
			errs = append(errs, fmt.Errorf("client: %w", err))
		}
		if err := t.qt.Close(); err != nil {
			errs = append(errs, fmt.Errorf("quic: %w", err))
		}
		if t.ownPC {
			if err := t.pc.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
				errs = append(errs, fmt.Errorf("socket: %w", err))
			}
		}
		t.closeErr = errors.Join(errs...)
	})
	return t.closeErr
}

// RoundTrip sends r to the peer agent named by r.URL.Host (a node id, no
// port) over HTTP/3, scheme https. The peer must be admitted now (PeerKey,
// checked on every call); it is dialed at its PeerAddr and its certificate
// pinned to its PeerKey. A live connection to it is reused unless the
// peer's key changed since it was verified; one to a peer that moved is
// closed by the re-check loop. Cancelling r's context resets the request
// stream, which cancels the request on the peer.
func (t *Transport) RoundTrip(r *http.Request) (*http.Response, error) {
	node := r.URL.Host
	fail := func(err error) (*http.Response, error) {
		if r.Body != nil {
			_ = r.Body.Close()
		}
		return nil, err
	}
	if err := identity.ValidateNodeName(node); err != nil {
		return fail(fmt.Errorf("mesh transport: request host %q is not a node id: %w", node, err))
	}
	key, ok := t.dir.PeerKey(node)
	if !ok {
		return fail(fmt.Errorf("peer %q: %w", node, ErrUnknownPeer))
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return fail(ErrTransportClosed)
	}
	d := t.dialed[node]
	stale := d != nil && !d.key.Equal(key)
	if stale {
		delete(t.dialed, node)
	}
	h := t.heard[node]
	if h == nil {
		h = &heardFrom{}
		t.heard[node] = h
	}
	t.mu.Unlock()
	if stale {
		// http3 finds the connection closed and dials afresh (pinning the new key).
		_ = d.conn.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), "peer identity changed")
	}
	resp, err := t.h3.RoundTrip(r)
	if err != nil {
		if errors.Is(err, http3.ErrTransportClosed) {
			return nil, ErrTransportClosed
		}
		if headTooLarge(err) {
			return nil, fmt.Errorf("peer %q: %w: %w", node, ErrResponseHeadTooLarge, err)
		}
		return nil, fmt.Errorf("peer %q: %w", node, err)
	}
	h.stamp()
	if err := checkResponseHead(node, resp); err != nil {
		return nil, err
	}
	resp.Body = &heardBody{ReadCloser: resp.Body, h: h}
	return resp, nil
}

// dial is http3's dial function: hostport is "<node>:443" (http3 adds the
// default port to the URL host). It dials the node's advertised address
// from our socket and pins its certificate to the node's key.
func (t *Transport) dial(ctx context.Context, hostport string, tlsCfg *tls.Config, qc *quic.Config) (*quic.Conn, error) {
	node, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	addr, ok := t.dir.PeerAddr(node)
	if !ok {
		return nil, fmt.Errorf("peer %q: %w", node, ErrUnknownPeer)
	}
	key, ok := t.dir.PeerKey(node)
	if !ok {
		return nil, fmt.Errorf("peer %q: %w", node, ErrUnknownPeer)
	}
	ctx, cancel := context.WithTimeout(ctx, t.cfg.HandshakeTimeout)
	defer cancel()
	ua, err := resolveUDP(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("peer %q: address %q: %w", node, addr, err)
	}
	tlsCfg.ServerName = node
	tlsCfg.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
		if _, got, err := verifyNodeCert(t.dir, raw, node); err != nil {
			t.refused(err, "addr:"+hostOf(addr))
			return err
		} else if !got.Equal(key) {
			// The directory changed between lookup and handshake: stay
			// consistent with what RoundTrip will compare against.
			return &refusalError{why: RefusedKeyMismatch, node: node, msg: "peer key changed during the handshake"}
		}
		return nil
	}
	conn, err := t.qt.Dial(ctx, ua, tlsCfg, qc)
	if err != nil {
		return nil, fmt.Errorf("dial peer %q at %s: %w", node, addr, err)
	}
	t.mu.Lock()
	closed := t.closed
	if !closed {
		t.dialed[node] = &dialedConn{conn: conn, node: node, addr: addr, key: key}
	}
	t.mu.Unlock()
	if closed {
		_ = conn.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), "")
		return nil, ErrTransportClosed
	}
	t.log.Debug("dialed peer", zap.String("peer", node), zap.String("addr", addr))
	return conn, nil
}

func resolveUDP(ctx context.Context, addr string) (*net.UDPAddr, error) {
	host, port, err := splitHostPort(addr)
	if err != nil {
		return nil, err
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil, err
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("no address for %q", host)
	}
	return &net.UDPAddr{IP: ips[0].Unmap().AsSlice(), Port: port}, nil
}

// serverTLSConfig asks every client for its certificate and pins it; a
// config per handshake lets a refusal name the remote address.
func (t *Transport) serverTLSConfig() *tls.Config {
	base := baseTLSConfig(t.cert)
	// RequestClientCert rather than Require: VerifyPeerCertificate then sees
	// (and refuses, counts and audits) a client without a certificate too.
	base.ClientAuth = tls.RequestClientCert
	base.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		remote := "unknown"
		if hello.Conn != nil && hello.Conn.RemoteAddr() != nil {
			remote = hello.Conn.RemoteAddr().String()
		}
		c := baseTLSConfig(t.cert)
		c.ClientAuth = tls.RequestClientCert
		c.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
			_, _, err := verifyNodeCert(t.dir, raw, "")
			if err != nil {
				t.refused(err, "addr:"+hostOf(remote))
			}
			return err
		}
		return c, nil
	}
	return base
}

// connContext attaches the verified peer to every request of a
// connection, as admitConn registered it (for re-checks and its node's
// bounds).
func (t *Transport) connContext(ctx context.Context, c *quic.Conn) context.Context {
	t.mu.Lock()
	v := t.served[c]
	t.mu.Unlock()
	if v == nil {
		return ctx // servePeer refuses: admitConn registers every connection it lets through
	}
	return context.WithValue(ctx, peerCtxKey{}, v)
}

// RefusedHeader marks an answer as this agent's own refusal of the peer
// (not its instance's answer), with the reason as its value: the consumer
// then tries its next candidate. The proxy's peer handler uses the same
// header (proxy.RefusedHeader) for roles not served to the peer.
const RefusedHeader = "Infermesh-Refused"

// PeerFromRequest returns the node a request's connection was verified as,
// for requests served by a Transport. It is the only peer identity to trust:
// headers and the request's host say nothing about who sent it.
func PeerFromRequest(r *http.Request) (string, bool) {
	v, ok := r.Context().Value(peerCtxKey{}).(*verified)
	if !ok {
		return "", false
	}
	return v.node, true
}

// servePeer re-checks the peer's admission (it may have been revoked since
// the handshake; the re-check loop closes such connections, this closes the
// window), counts the request against its node's bounds, puts its body
// under BodyTimeout and hands it to the Handler.
func (t *Transport) servePeer(w http.ResponseWriter, r *http.Request) {
	// http3 runs every request on a new goroutine with the smallest stack;
	// the proxy's handler then grows it step by step, each step copying a
	// deeper stack. Growing it here, while it is shallow, is one cheap
	// copy: about 16k instructions less per request on the serving agent,
	// and the stack ends no bigger (it reaches 8 KiB anyway).
	growStack(0)
	v, ok := r.Context().Value(peerCtxKey{}).(*verified)
	if !ok {
		w.Header().Set(RefusedHeader, "unknown_peer")
		writePeerError(w, http.StatusForbidden, "permission_error", "forbidden", "peer identity unknown")
		return
	}
	if r.URL.Path == keyringPath {
		// Admits, and audits its refusals, itself; its body is bounded
		// in time like any other.
		t.bodyDeadline(w, r)
		t.serveKeyring(w, r, v)
		return
	}
	if !t.stillValid(v.node, v.key) {
		t.refused(&refusalError{why: RefusedNotAdmitted, node: v.node, msg: "no longer admitted"}, "")
		w.Header().Set(RefusedHeader, "not_admitted")
		writePeerError(w, http.StatusForbidden, "permission_error", "forbidden", "this node does not admit you")
		return
	}
	if r.URL.Path == probePath {
		t.serveProbe(w)
		return
	}
	if r.URL.Path == infoPath {
		t.serveInfo(w, r)
		return
	}
	release, ok := t.admitStream(w, v)
	if !ok {
		return
	}
	defer release()
	t.bodyDeadline(w, r)
	if r.URL.Path == revocationPath {
		t.serveRevocation(w, r, v.node)
		return
	}
	if t.cfg.Handler == nil {
		writePeerError(w, http.StatusNotFound, "not_found_error", "unknown_url", "nothing is served to peers here")
		return
	}
	t.cfg.Handler.ServeHTTP(w, r)
}

// growStack grows the calling goroutine's stack from the 2 KiB a
// goroutine starts with to 8 KiB in one step: its frame of 4 KiB does not
// fit in 4 KiB. i is 0; it keeps the frame from being optimized away.
//
//go:noinline
func growStack(i int) byte {
	var b [4 << 10]byte
	b[i] = 1
	return b[len(b)-1-i]
}

// stillValid reports whether node is still trusted with key. Gossip
// liveness is not asked: a falsely suspected peer's working connection and
// its streams survive; a revoked or re-keyed one is cut.
func (t *Transport) stillValid(node string, key ed25519.PublicKey) bool {
	return t.dir.TrustsKey(node, key)
}

// writePeerError writes an OpenAI-shaped error.
func writePeerError(w http.ResponseWriter, status int, typ, code, msg string) {
	b := []byte(`{"error":{"message":` + strconv.Quote(msg) + `,"type":` + strconv.Quote(typ) +
		`,"param":null,"code":` + strconv.Quote(code) + "}}\n")
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// recheck closes connections whose peer is no longer admitted, changed its
// key, or (for ours) moved, and forgets closed ones. Collects under the
// lock, asks the directory and closes after.
func (t *Transport) recheck() {
	type entry struct {
		conn   *quic.Conn
		node   string
		key    ed25519.PublicKey
		addr   string
		dialed bool
	}
	t.mu.Lock()
	list := make([]entry, 0, len(t.dialed)+len(t.served))
	for _, d := range t.dialed {
		list = append(list, entry{d.conn, d.node, d.key, d.addr, true})
	}
	for c, v := range t.served {
		list = append(list, entry{c, v.node, v.key, "", false})
	}
	t.mu.Unlock()
	var gone []entry
	for _, e := range list {
		if e.conn.Context().Err() != nil {
			gone = append(gone, e)
			continue
		}
		why := ""
		switch {
		case !t.stillValid(e.node, e.key):
			why = "peer no longer admitted"
		case e.dialed:
			// A live member that now advertises another address moved; one
			// that is not a member right now keeps its working connection.
			if a, ok := t.dir.PeerAddr(e.node); ok && a != e.addr {
				why = "peer address changed"
			}
		}
		if why != "" {
			t.log.Info("closing peer connection", zap.String("peer", e.node), zap.Bool("dialed", e.dialed), zap.String("why", why))
			_ = e.conn.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), why)
			gone = append(gone, e)
		}
	}
	if len(gone) == 0 {
		return
	}
	t.mu.Lock()
	for _, e := range gone {
		if e.dialed {
			if d := t.dialed[e.node]; d != nil && d.conn == e.conn {
				delete(t.dialed, e.node)
			}
		} else {
			delete(t.served, e.conn)
		}
	}
	t.mu.Unlock()
}

// refused counts a refusal and reports it (rate-limited) to OnRefused.
// source is where it came from ("addr:<ip>" for a handshake, the port left
// out), "" for a verified peer. The rate limit is keyed on the source when
// there is one, never on a name the other side merely claims: a flood of
// handshakes from fresh ports, or naming ever new nodes, is audited once
// per source and reason per interval.
func (t *Transport) refused(err error, source string) {
	var re *refusalError
	if !errors.As(err, &re) {
		return
	}
	peer := re.node
	if peer == "" {
		peer = source
	}
	limitKey := source
	if limitKey == "" {
		limitKey = peer
	}
	if !t.refusals.count(AuditQUICRefused, limitKey, "", re.why) {
		return
	}
	t.log.Info("peer refused", zap.String("peer", peer), zap.String("why", re.why), zap.String("detail", re.msg))
	if t.cfg.OnRefused != nil {
		t.cfg.OnRefused(peer, re.why)
	}
}

// hostOf is addr without its port (addr itself when it has none).
func hostOf(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// Refusals returns how many peers were refused, by reason (the Refused*
// constants).
func (t *Transport) Refusals() map[string]uint64 { return t.refusals.snapshot() }

// desiredUDPBuffer is the socket buffer size quic-go asks for.
const desiredUDPBuffer = 7 << 20

// checkBuffers warns when the kernel kept the socket buffers below what
// quic-go asked for (it tries, and as root forces, on Listen).
func (t *Transport) checkBuffers() {
	sc, ok := t.pc.(syscall.Conn)
	if !ok {
		return
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return
	}
	var rcv, snd int
	_ = raw.Control(func(fd uintptr) {
		rcv, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF)
		snd, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF)
	})
	if rcv < desiredUDPBuffer || snd < desiredUDPBuffer {
		t.log.Warn("UDP socket buffers are smaller than QUIC wants; install configs/60-infermesh-quic.conf in /etc/sysctl.d and run sysctl --system",
			zap.Int("receive_bytes", rcv), zap.Int("send_bytes", snd), zap.Int("want_bytes", desiredUDPBuffer))
	}
}
