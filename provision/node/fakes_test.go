package node

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// fakeClient is a scripted SSH client. reply decides each command's
// output and exit; by default every command succeeds silently, the probe
// echoes and keygen prints a key.
type fakeClient struct {
	connectErr error
	reply      func(line string, stdin []byte) (stdout, stderr []string, code int, err error)
	// block makes the command matching it wait until the client closes.
	block string

	mu       sync.Mutex
	lines    []string
	closed   atomic.Bool
	closedCh chan struct{}
	once     sync.Once
}

func newFakeClient() *fakeClient { return &fakeClient{closedCh: make(chan struct{})} }

func (c *fakeClient) Connect(ctx context.Context, ep Endpoint, retry func(ConnectRetry)) error {
	if c.closed.Load() {
		return errors.New("closed")
	}
	return c.connectErr
}

func (c *fakeClient) Run(ctx context.Context, rc RemoteCommand) (int, error) {
	if c.closed.Load() {
		return -1, errors.New("connection closed")
	}
	var stdin []byte
	if rc.Stdin != nil {
		stdin, _ = io.ReadAll(rc.Stdin)
	}
	c.mu.Lock()
	c.lines = append(c.lines, rc.Line)
	c.mu.Unlock()
	if c.block != "" && strings.Contains(rc.Line, c.block) {
		select {
		case <-c.closedCh:
			return -1, errors.New("connection closed")
		case <-ctx.Done():
			return -1, ctx.Err()
		}
	}
	var out, errOut []string
	code := 0
	var err error
	switch {
	case c.reply != nil:
		out, errOut, code, err = c.reply(rc.Line, stdin)
		if out == nil && errOut == nil && code == 0 && err == nil {
			out = defaultReply(rc.Line)
		}
	default:
		out = defaultReply(rc.Line)
	}
	for _, l := range out {
		if rc.Stdout != nil {
			rc.Stdout(l)
		}
	}
	for _, l := range errOut {
		if rc.Stderr != nil {
			rc.Stderr(l)
		}
	}
	return code, err
}

const fakeNodeKey = "c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8="

func defaultReply(line string) []string {
	switch {
	case strings.HasPrefix(line, "echo infermesh-probe-"):
		return []string{strings.TrimPrefix(line, "echo ")}
	case strings.Contains(line, "-keygen"):
		return []string{fakeNodeKey}
	case strings.Contains(line, "systemctl is-active"):
		return []string{"active"}
	case strings.HasPrefix(line, "sha256sum "):
		return []string{strings.Repeat("ab", 32) + "  " + strings.TrimPrefix(line, "sha256sum ")}
	}
	return nil
}

func (c *fakeClient) Close() error {
	c.once.Do(func() {
		c.closed.Store(true)
		close(c.closedCh)
	})
	return nil
}

func (c *fakeClient) ran() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.lines)
}

type fakeFactory struct{ c *fakeClient }

func (f fakeFactory) ClientFor(SessionSpec) Client { return f.c }

// fakeLease records what it was asked and answers as configured.
type fakeLease struct {
	kind        Kind
	createErr   error
	noEndpoint  bool // Create returns no endpoint
	lookupFails bool // LookupEndpoint finds none
	destroyErr  error
	onCreate    func(Spec) // runs first in Create

	mu        sync.Mutex
	created   []Spec
	destroyed []DestroyHandle
}

func (l *fakeLease) Kind() Kind { return l.kind }

func (l *fakeLease) Create(ctx context.Context, spec Spec) (LeaseFacts, *Endpoint, error) {
	if l.onCreate != nil {
		l.onCreate(spec)
	}
	l.mu.Lock()
	l.created = append(l.created, spec)
	l.mu.Unlock()
	if spec.Provider != l.kind {
		return LeaseFacts{}, nil, errors.New("refusing a spec of another provider")
	}
	if l.createErr != nil {
		return LeaseFacts{}, nil, l.createErr
	}
	facts := LeaseFacts{Provider: l.kind, ID: LeaseID(string(l.kind) + ":c1"), ContractID: "c1", HostKeys: []string{"ssh-ed25519 AAAA"}}
	if l.noEndpoint {
		return facts, nil, nil
	}
	ep := Endpoint{Host: "10.9.0.2", Port: 22, User: "root"}
	return facts, &ep, nil
}

func (l *fakeLease) LookupEndpoint(ctx context.Context, f LeaseFacts) (Endpoint, bool, error) {
	if l.lookupFails {
		return Endpoint{}, false, nil
	}
	return Endpoint{Host: "10.9.0.2", Port: 22, User: "root"}, true, nil
}

func (l *fakeLease) Destroy(ctx context.Context, h DestroyHandle) error {
	l.mu.Lock()
	l.destroyed = append(l.destroyed, h)
	l.mu.Unlock()
	return l.destroyErr
}

func (l *fakeLease) destroyCalls() []DestroyHandle {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.destroyed)
}

// recSink keeps every record and counts flushes.
type recSink struct {
	mu      sync.Mutex
	records []LogRecord
	flushes int
}

func (s *recSink) Record(r LogRecord) {
	s.mu.Lock()
	s.records = append(s.records, r)
	s.mu.Unlock()
}

func (s *recSink) Flush() {
	s.mu.Lock()
	s.flushes++
	s.mu.Unlock()
}

// memIntents is an IntentStore in memory that remembers every write.
type memIntents struct {
	mu      sync.Mutex
	m       map[string]Record
	history []Record
}

func newMemIntents() *memIntents { return &memIntents{m: map[string]Record{}} }

func (s *memIntents) Put(r Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[r.Spec.Name] = r
	s.history = append(s.history, r)
	return nil
}

func (s *memIntents) Delete(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, name)
	return nil
}

func (s *memIntents) List() ([]Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Record, 0, len(s.m))
	for _, r := range s.m {
		out = append(out, r)
	}
	return out, nil
}

func (s *memIntents) get(name string) (Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[name]
	return r, ok
}

func testSpec(kind Kind) Spec {
	s := Spec{
		Name: "gpu-7", Run: 42, Provider: kind,
		Roles: []Role{{Name: "chat", Port: 18080, Upstream: "http://127.0.0.1:18180", Consumed: true}},
		Join:  []string{"10.9.0.1:7946"}, JoinCredentialRef: "file:/var/lib/infermesh/node.cert",
		Boot: BootSpec{
			StdoutSources: []string{"cat /etc/os-release"},
			StderrSources: []string{"systemctl --failed"},
			Verify:        []Check{{Name: "systemd", Command: "test -d /run/systemd/system", Hint: "the host does not run systemd"}},
		},
	}
	switch kind {
	case KindDocker:
		s.Docker = &DockerTarget{Image: "infermesh-node:x", Network: "n"}
	case KindSSH:
		s.SSH = &SSHTarget{User: "root", Host: "10.9.0.2", Port: 22, Fingerprints: []string{"SHA256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}}
	}
	return s
}

func testInstall() Install {
	return Install{
		Account: &Account{
			Sysusers: File{Path: "/etc/sysusers.d/infermesh.conf", Mode: 0o644, Data: []byte("u infermesh - \"infermesh agent\" /var/lib/infermesh\n")},
			User:     "infermesh", JoinIfPresent: []string{"docker"},
		},
		Dirs:       []Dir{{Path: "/var/lib/infermesh", Mode: 0o700}, {Path: "/etc/infermesh", Mode: 0o755}},
		StagingDir: "/var/lib/infermesh",
		Files: []File{
			{Path: "/etc/infermesh/infermesh.yaml", Mode: 0o640, Data: []byte("node: {name: gpu-7}\n"), Group: "infermesh"},
			{Path: "/etc/systemd/system/infermeshd.service", Mode: 0o644, Data: []byte("[Unit]\n")},
		},
		Keygen: "/usr/local/bin/infermeshd -config /etc/infermesh/infermesh.yaml -keygen",
		Issue: func(ctx context.Context, pub string) (File, error) {
			return File{Path: "/var/lib/infermesh/node.cert", Mode: 0o600, Data: []byte("cert-for-" + pub)}, nil
		},
		Units: []string{"infermeshd.service"},
	}
}

type harness struct {
	t       *testing.T
	client  *fakeClient
	lease   *fakeLease
	sink    *recSink
	intents *memIntents
	p       *Provisioner
	changes []Record
}

func newHarness(t *testing.T, kind Kind) *harness {
	t.Helper()
	h := &harness{t: t, client: newFakeClient(), lease: &fakeLease{kind: kind}, sink: &recSink{}, intents: newMemIntents()}
	p, err := NewProvisioner(ProvisionerConfig{
		Lease: h.lease, Clients: fakeFactory{h.client}, Sink: h.sink, Intents: h.intents,
		OnChange: func(r Record) { h.changes = append(h.changes, r) },
	})
	if err != nil {
		t.Fatal(err)
	}
	h.p = p
	return h
}

// fixed is a plan that installs in whatever the endpoint.
func fixed(in Install) Plan {
	return func(context.Context, Endpoint) (Install, error) { return in, nil }
}
