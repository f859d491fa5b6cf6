package mesh

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/placement"
)

func TestMain(m *testing.M) {
	leakcheck.VerifyTestMain(m, nil)
}

// testCluster holds what the nodes of one test share: a state root, a
// gossip keyring and an authority key that issues every node a certificate.
type testCluster struct {
	t         *testing.T
	root      string
	keyring   string
	authority ed25519.PrivateKey
	nextIP    atomic.Int32
	ttl       time.Duration
	tweak     func(*Config)
}

func newTestCluster(t *testing.T) *testCluster {
	t.Helper()
	root := t.TempDir()
	kr := filepath.Join(root, "keyring.json")
	if _, err := identity.WriteNewKeyring(kr); err != nil {
		t.Fatal(err)
	}
	_, auth, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	c := &testCluster{t: t, root: root, keyring: kr, authority: auth, ttl: 5 * time.Second}
	c.nextIP.Store(1)
	return c
}

// testNode is one mesh node with its placement table.
type testNode struct {
	name  string
	m     *Mesh
	tab   *placement.Table
	audit *recordingAudit
	clock *offsetClock
}

type offsetClock struct{ off atomic.Int64 }

func (c *offsetClock) Now() time.Time          { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *offsetClock) Advance(d time.Duration) { c.off.Add(int64(d)) }

type recordingAudit struct {
	mu     sync.Mutex
	events []placement.AuditEvent
}

func (r *recordingAudit) Audit(e placement.AuditEvent) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

func (r *recordingAudit) has(kind, why string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.ContainsFunc(r.events, func(e placement.AuditEvent) bool { return e.Kind == kind && e.Fields["why"] == why })
}

// membership reports whether a membership event of kind for node was
// audited.
func (r *recordingAudit) membership(kind, node string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.ContainsFunc(r.events, func(e placement.AuditEvent) bool { return e.Kind == kind && e.Node == node })
}

// config returns a fast test config for name: short gossip, probe and TTL
// so that the tests finish quickly; addresses are distinct 127.0.0.x with
// memberlist picking the port.
func (c *testCluster) config(name string) Config {
	ip := c.nextIP.Add(1)
	cfg := Config{
		NodeName:         name,
		StateDir:         filepath.Join(c.root, name),
		Cluster:          "test",
		BindAddr:         fmt.Sprintf("127.0.0.%d:0", ip),
		QUICAddr:         fmt.Sprintf("127.0.0.%d:7947", ip),
		KeyringPath:      c.keyring,
		Trust:            TrustConfig{Authorities: []ed25519.PublicKey{c.authority.Public().(ed25519.PublicKey)}},
		AdvertTTL:        c.ttl,
		GossipInterval:   20 * time.Millisecond,
		ProbeInterval:    100 * time.Millisecond,
		ProbeTimeout:     50 * time.Millisecond,
		PushPullInterval: time.Minute, // convergence tests must not lean on periodic push/pull
		SuspicionMult:    2,
		RetransmitMult:   3,
		TCPTimeout:       time.Second,
		JoinBackoff:      20 * time.Millisecond,
		JoinMaxBackoff:   100 * time.Millisecond,
	}
	if c.tweak != nil {
		c.tweak(&cfg)
	}
	return cfg
}

// certFor makes name's key in its state dir and returns a certificate.
func (c *testCluster) certFor(cfg Config, scope identity.Scope, ttl time.Duration) string {
	c.t.Helper()
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		c.t.Fatal(err)
	}
	key, _, err := identity.LoadOrCreateKey(filepath.Join(cfg.StateDir, identity.NodeKeyFile))
	if err != nil {
		c.t.Fatal(err)
	}
	cert, err := identity.IssueCertificate(c.authority, cfg.NodeName, key.Public().(ed25519.PublicKey), scope, ttl, time.Now())
	if err != nil {
		c.t.Fatal(err)
	}
	return cert.String()
}

// node starts an admitted (full-scope certificate) node.
func (c *testCluster) node(name string) *testNode {
	cfg := c.config(name)
	cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
	return c.start(cfg)
}

// start starts a node from cfg with a placement table as its sink (unless
// cfg.Sink was set to something else by the caller).
func (c *testCluster) start(cfg Config) *testNode {
	c.t.Helper()
	n := &testNode{name: cfg.NodeName, audit: &recordingAudit{}, clock: &offsetClock{}}
	adm := &AdmissionProxy{}
	tab, err := placement.New(placement.Config{NodeID: cfg.NodeName, Admission: adm, Audit: n.audit, AdvertTTL: cfg.AdvertTTL})
	if err != nil {
		c.t.Fatal(err)
	}
	n.tab = tab
	if cfg.Sink == nil {
		cfg.Sink = tab
	} else if _, ok := cfg.Sink.(noSink); ok {
		cfg.Sink = nil
	}
	cfg.Audit = n.audit
	cfg.Now = n.clock.Now
	m, err := New(cfg)
	if err != nil {
		c.t.Fatalf("New(%s): %v", cfg.NodeName, err)
	}
	adm.Bind(m)
	n.m = m
	c.t.Cleanup(func() { m.Close() })
	return n
}

// noSink asks start for a node without a sink.
type noSink struct{ AdvertSink }

func (n *testNode) join(t *testing.T, to ...*testNode) {
	t.Helper()
	addrs := make([]string, len(to))
	for i, o := range to {
		addrs[i] = o.m.GossipAddr()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := n.m.JoinAddrs(ctx, addrs); err != nil {
		t.Fatalf("%s join: %v", n.name, err)
	}
}

// serve makes n serve role locally and expose it.
func (n *testNode) serve(t *testing.T, role, model string) {
	t.Helper()
	if err := n.tab.RegisterLocal(role, placement.Local{Base: "http://127.0.0.1:9999", Model: model, API: "openai", Runtime: "demo"}); err != nil {
		t.Fatal(err)
	}
	n.tab.ExposeToMesh(role, true)
}

// remotes returns the remote nodes n resolves role to.
func (n *testNode) remotes(role string) []string {
	var out []string
	for _, c := range n.tab.Resolve(role) {
		if c.Kind == placement.KindRemote {
			out = append(out, c.Node)
		}
	}
	return out
}

func (n *testNode) resolvesTo(role, node string) bool {
	return slices.Contains(n.remotes(role), node)
}

func (n *testNode) refusals(why string) uint64 { return n.m.Refusals()[why] }

// eventually polls cond every 10ms until it holds or timeout, stretched
// (loadFactor, at least 15s) so that a machine with a load average of 15
// under -race fails no test: timeout says how soon cond holds on a quiet
// machine, not a speed the test asserts.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, max(timeout*loadFactor, 15*time.Second), cond)
}

// loadFactor stretches the tests' waits for a loaded machine.
const loadFactor = 5

func memberNames(m *Mesh) []string {
	var out []string
	for _, p := range m.Members() {
		out = append(out, p.Name)
	}
	return out
}
