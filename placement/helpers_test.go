package placement

import (
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock for TTL tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// fakeAdmission admits nodes by name, with a scope. Safe for concurrent use.
type fakeAdmission struct {
	mu    sync.Mutex
	nodes map[string]string // node -> "full" | "consumer"
	// left are nodes trusted but not live members (a peer restarting):
	// Trusted only.
	left map[string]bool
}

func newAdmission(full ...string) *fakeAdmission {
	a := &fakeAdmission{nodes: map[string]string{}}
	for _, n := range full {
		a.nodes[n] = "full"
	}
	return a
}

func (a *fakeAdmission) set(node, scope string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.left, node)
	if scope == "" {
		delete(a.nodes, node)
		return
	}
	a.nodes[node] = scope
}

func (a *fakeAdmission) IsAdmitted(node string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, ok := a.nodes[node]
	return ok
}

func (a *fakeAdmission) Trusted(node string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, ok := a.nodes[node]
	return ok || a.left[node]
}

// leave makes node trusted but no longer a live member.
func (a *fakeAdmission) leave(node string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.nodes, node)
	if a.left == nil {
		a.left = map[string]bool{}
	}
	a.left[node] = true
}

func (a *fakeAdmission) MayServe(node string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.nodes[node] == "full"
}

var _ Admission = (*fakeAdmission)(nil)

// recordingAudit keeps every event.
type recordingAudit struct {
	mu     sync.Mutex
	events []AuditEvent
	// table, when set, is called back during Audit to prove the event is
	// emitted outside the table's lock (a held lock would deadlock).
	table *Table
}

func (r *recordingAudit) Audit(e AuditEvent) {
	if r.table != nil {
		_ = r.table.Generation()
		r.table.SetProxyPort("audit-probe", 1) // needs the write lock
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recordingAudit) take() []AuditEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	ev := r.events
	r.events = nil
	return ev
}

var _ AuditSink = (*recordingAudit)(nil)

type testEnv struct {
	t     *Table
	clock *fakeClock
	adm   *fakeAdmission
	audit *recordingAudit
}

// newTestTable returns table "a" with admission for full nodes b, c, d, a
// fake clock, a 60s TTL and a recording audit sink.
func newTestTable(tb testing.TB) testEnv {
	tb.Helper()
	env := testEnv{clock: newFakeClock(), adm: newAdmission("b", "c", "d"), audit: &recordingAudit{}}
	tbl, err := New(Config{NodeID: "a", Admission: env.adm, Audit: env.audit, Now: env.clock.Now, AdvertTTL: time.Minute})
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	env.t = tbl
	return env
}

func advert(role, node string, load uint32) Advert {
	return Advert{Name: ServicePrefix + role, Node: node, API: "openai", Runtime: "llama.cpp", Model: "m-" + node, Load: load, Methods: AdvertMethods()}
}

// hear allowlists node for role and ingests its advert, failing the test on refusal.
func (e testEnv) hear(tb testing.TB, role, node string, load uint32) {
	tb.Helper()
	e.t.AllowRemoteNode(role, node, true)
	if err := e.t.IngestAdvertisement(node, advert(role, node, load)); err != nil {
		tb.Fatalf("IngestAdvertisement(%s, %s) = %v, want nil", node, role, err)
	}
}

func nodes(c []Candidate) []string {
	var out []string
	for _, x := range c {
		out = append(out, x.Node)
	}
	return out
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
