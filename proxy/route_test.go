package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/routing"
)

// outcomes records the proxy's finished requests.
type outcomes struct {
	mu  sync.Mutex
	all []Outcome
}

func (o *outcomes) Attempt(string, string, int, error, time.Duration) {}
func (o *outcomes) StreamOpen(string)                                 {}
func (o *outcomes) StreamClose(string)                                {}
func (o *outcomes) Done(x Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.all = append(o.all, x)
}

func (o *outcomes) byID(id string) (Outcome, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, x := range o.all {
		if x.RequestID == id {
			return x, true
		}
	}
	return Outcome{}, false
}

// mutableResolver returns what set last set; with fresh, each answer
// gives the peers a new LoadSeq, as if an advert or a load report had
// just come (their loads are never older than staleLoad).
type mutableResolver struct {
	mu    sync.Mutex
	c     []placement.Candidate
	fresh bool
	seq   uint64
}

func (m *mutableResolver) set(c ...placement.Candidate) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.c = c
}

func (m *mutableResolver) Resolve(string) []placement.Candidate {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := append([]placement.Candidate(nil), m.c...)
	if m.fresh {
		m.seq++
		for i := range out {
			if out[i].Kind == placement.KindRemote {
				out[i].LoadSeq = m.seq
			}
		}
	}
	return out
}

// gate is an instance whose answers wait until released, by request id;
// it records the order requests arrived in.
type gate struct {
	mu      sync.Mutex
	arrived []string
	release map[string]chan struct{}
}

func newGate() *gate { return &gate{release: map[string]chan struct{}{}} }

func (g *gate) ch(name string) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, ok := g.release[name]
	if !ok {
		c = make(chan struct{})
		g.release[name] = c
	}
	return c
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	name := r.Header.Get(RequestIDHeader) // crosses the hop (MeshHeaders)
	g.mu.Lock()
	g.arrived = append(g.arrived, name)
	g.mu.Unlock()
	select {
	case <-g.ch(name):
	case <-r.Context().Done():
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","model":"m","choices":[]}`)
}

func (g *gate) order() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.arrived...)
}

func (g *gate) has(name string) bool { return strings.Contains(strings.Join(g.order(), ","), name) }

type routeEnv struct {
	url   string
	p     *Proxy
	res   *mutableResolver
	local *gate
	peer  *gate
	obs   *outcomes
}

func newRouteEnv(t *testing.T, rc RouteConfig) *routeEnv { return newRouteEnvWith(t, rc, nil) }

// newRouteEnvWith is newRouteEnv with mod applied to the proxy's config.
func newRouteEnvWith(t *testing.T, rc RouteConfig, mod func(*Config)) *routeEnv {
	t.Helper()
	e := &routeEnv{res: &mutableResolver{}, local: newGate(), peer: newGate(), obs: &outcomes{}}
	lsrv := httptest.NewServer(e.local)
	psrv := httptest.NewServer(e.peer)
	t.Cleanup(func() {
		lsrv.CloseClientConnections()
		psrv.CloseClientConnections()
		lsrv.Close()
		psrv.Close()
	})
	cfg := Config{Resolver: e.res, Remote: loopRemote{"b": psrv.URL}, Observer: e.obs,
		Routing: func(string) RouteConfig { return rc }}
	if mod != nil {
		mod(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := p.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = p.Shutdown(ctx)
	})
	e.p, e.url = p, "http://"+addr.String()
	e.res.set(
		placement.Candidate{Kind: placement.KindLocal, Node: "a", Base: lsrv.URL, Model: "m", Capacity: placement.Capacity{Slots: 1}},
		placement.Candidate{Kind: placement.KindRemote, Node: "b", Model: "m", Capacity: placement.Capacity{Slots: 1}},
	)
	return e
}

type answer struct {
	status int
	retry  string
	body   string
	err    error
}

// send posts a chat request named name (its X-Request-Id) and
// delivers its answer.
func (e *routeEnv) send(ctx context.Context, name string) <-chan answer {
	return e.sendBody(ctx, name, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
}

func (e *routeEnv) sendBody(ctx context.Context, name, body string, hdr ...string) <-chan answer {
	out := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.url+pathChat, strings.NewReader(body))
		req.Header.Set(RequestIDHeader, name)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			out <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out <- answer{status: resp.StatusCode, retry: resp.Header.Get("Retry-After"), body: string(b)}
	}()
	return out
}

func wait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, 10*time.Second, cond)
}

// outcome waits for the outcome of the request named id.
func (e *routeEnv) outcome(t *testing.T, id string) Outcome {
	t.Helper()
	var o Outcome
	wait(t, "the outcome of "+id, func() bool {
		var ok bool
		o, ok = e.obs.byID(id)
		return ok
	})
	return o
}

func (e *routeEnv) reason(t *testing.T, id string) string {
	t.Helper()
	o := e.outcome(t, id)
	if o.Route == nil {
		t.Fatalf("%s: no route recorded", id)
	}
	return o.Route.Reason
}

// A local instance whose one slot is taken (by the agent's own count)
// spills the next request to the idle peer; once it is free again the
// local instance is preferred.
func TestRouteSpillsFromASaturatedLocalInstance(t *testing.T) {
	e := newRouteEnv(t, RouteConfig{})
	first := e.send(t.Context(), "first")
	wait(t, "first at the local instance", func() bool { return e.local.has("first") })
	second := e.send(t.Context(), "second")
	wait(t, "second at the peer", func() bool { return e.peer.has("second") })
	close(e.peer.ch("second"))
	if a := <-second; a.status != 200 {
		t.Fatalf("second: %+v", a)
	}
	if r := e.reason(t, "second"); r != string(routing.ReasonSpill) {
		t.Errorf("second's reason %q, want spill", r)
	}
	close(e.local.ch("first"))
	if a := <-first; a.status != 200 {
		t.Fatalf("first: %+v", a)
	}
	if r := e.reason(t, "first"); r != string(routing.ReasonLocal) {
		t.Errorf("first's reason %q, want local", r)
	}
	third := e.send(t.Context(), "third")
	wait(t, "third at the local instance", func() bool { return e.local.has("third") })
	close(e.local.ch("third"))
	<-third
}

// A keyed request is recorded in the prefix index at its key's node, not
// where it spilled: the spill target caches it only until its own tenants
// evict it.
func TestRouteIndexesOnlyTheKeysNode(t *testing.T) {
	e := newRouteEnv(t, RouteConfig{})
	body := `{"model":"m","prompt_cache_key":"tenant-1","messages":[{"role":"system","content":"` + strings.Repeat("You are a careful assistant. ", 100) + `"},{"role":"user","content":"hi"}]}`
	blocks := func(target string) int { return e.p.router.index.Len(targetKey("chat", target)) }
	released := map[chan struct{}]bool{}
	release := func(id string) {
		for _, g := range []*gate{e.local, e.peer} {
			if c := g.ch(id); !released[c] {
				released[c] = true
				close(c)
			}
		}
	}
	t.Cleanup(func() { release("held"); release("spilled") })
	// Idle: the request goes to its key's node, which is indexed.
	first := e.sendBody(t.Context(), "first", body)
	wait(t, "first arrived", func() bool { return e.local.has("first") || e.peer.has("first") })
	release("first")
	<-first
	node := e.outcome(t, "first").Target
	other := map[string]string{"local": "b", "b": "local"}[node]
	if blocks(node) == 0 || blocks(other) != 0 {
		t.Fatalf("after first (at %s): %d blocks indexed at %s, %d at %s; want some at its node only", node, blocks(node), node, blocks(other), other)
	}
	gateOf := map[string]*gate{"local": e.local, "b": e.peer}
	// Its node's one slot held, at a service time of seconds (as
	// measured, not the test's few milliseconds): the next spills, and
	// is not indexed.
	for range 40 {
		e.p.router.stats.ObserveService(targetKey("chat", node), 10*time.Second)
	}
	held := e.sendBody(t.Context(), "held", body)
	wait(t, "held at "+node, func() bool { return gateOf[node].has("held") })
	spilled := e.sendBody(t.Context(), "spilled", body)
	wait(t, "spilled at "+other, func() bool { return gateOf[other].has("spilled") })
	release("spilled")
	<-spilled
	if o := e.outcome(t, "spilled"); o.Target != other || o.Route == nil || o.Route.Candidates[0].Affine {
		t.Fatalf("spilled: %+v, want served by %s, not the affine one", o, other)
	}
	if n := blocks(other); n != 0 {
		t.Errorf("%d blocks indexed at %s after a spill, want none", n, other)
	}
	release("held")
	<-held
}

// Under local-first the seed's order holds however busy the local
// instance is.
func TestRouteLocalFirstKeepsTheOrder(t *testing.T) {
	e := newRouteEnv(t, RouteConfig{Policy: routing.PolicyLocalFirst})
	first := e.send(t.Context(), "first")
	second := e.send(t.Context(), "second")
	wait(t, "both at the local instance", func() bool { return e.local.has("first") && e.local.has("second") })
	if e.peer.has("first") || e.peer.has("second") {
		t.Errorf("the peer got a request under local-first: %v", e.peer.order())
	}
	close(e.local.ch("first"))
	close(e.local.ch("second"))
	<-first
	<-second
	if r := e.reason(t, "second"); r != string(routing.ReasonLocal) {
		t.Errorf("reason %q, want local", r)
	}
}

// When every candidate is full, requests wait at the agent, first in first
// out, and go to whichever candidate frees a slot first; a full queue
// answers 503 server_busy with Retry-After at once; a request cancelled
// while queued frees its place at once; one that waits past the timeout
// gets 503 server_busy with Retry-After.
func TestRouteQueue(t *testing.T) {
	e := newRouteEnv(t, RouteConfig{QueueMax: 3, QueueTimeout: 20 * time.Second})
	e.res.fresh = true // b's load stays current: full means full
	long := e.send(t.Context(), "long")
	wait(t, "long at the local instance", func() bool { return e.local.has("long") })
	// b full too: one slot, one in flight (as its adverts say).
	cands := e.res.Resolve("chat")
	cands[1].Load = 1
	e.res.set(cands...)

	r1 := e.send(t.Context(), "r1")
	wait(t, "r1 queued", func() bool { return e.p.QueueLen("chat") == 1 })
	r2 := e.send(t.Context(), "r2")
	wait(t, "r2 queued", func() bool { return e.p.QueueLen("chat") == 2 })
	ctx, cancel := context.WithCancel(t.Context())
	gone := e.send(ctx, "gone")
	wait(t, "gone queued", func() bool { return e.p.QueueLen("chat") == 3 })

	full := <-e.send(t.Context(), "r3")
	if full.status != 503 || full.retry == "" || !strings.Contains(full.body, "server_busy") {
		t.Errorf("a request past a full queue: %+v, want 503 server_busy with Retry-After", full)
	}
	cancel()
	if a := <-gone; a.err == nil {
		t.Errorf("the cancelled request got an answer: %+v", a)
	}
	wait(t, "the queue back to r1 and r2", func() bool { return e.p.QueueLen("chat") == 2 })

	close(e.local.ch("long"))
	if a := <-long; a.status != 200 {
		t.Fatalf("long: %+v", a)
	}
	wait(t, "r1 at the local instance", func() bool { return e.local.has("r1") })
	if e.local.has("r2") || e.peer.has("r2") || e.p.QueueLen("chat") != 1 {
		t.Fatalf("r2 left the queue with no free slot: local %v, peer %v, queue %d", e.local.order(), e.peer.order(), e.p.QueueLen("chat"))
	}
	close(e.local.ch("r1"))
	<-r1
	wait(t, "r2 at the local instance", func() bool { return e.local.has("r2") })
	close(e.local.ch("r2"))
	<-r2
	if got := e.local.order(); strings.Join(got, ",") != "long,r1,r2" {
		t.Errorf("the local instance got %v, want long, r1, r2", got)
	}
	for _, id := range []string{"r1", "r2"} {
		if r := e.reason(t, id); r != string(routing.ReasonQueued) {
			t.Errorf("%s: reason %q, want queued", id, r)
		}
	}

	// A wait past the timeout.
	e2 := newRouteEnv(t, RouteConfig{QueueMax: 1, QueueTimeout: 100 * time.Millisecond})
	e2.res.fresh = true
	held := e2.send(t.Context(), "held")
	wait(t, "held at the local instance", func() bool { return e2.local.has("held") })
	cands = e2.res.Resolve("chat")
	cands[1].Load = 1
	e2.res.set(cands...)
	if a := <-e2.send(t.Context(), "late"); a.status != 503 || a.retry == "" || !strings.Contains(a.body, "stayed at capacity") {
		t.Errorf("a request that waited past the timeout: %+v", a)
	}
	if n := e2.p.QueueLen("chat"); n != 0 {
		t.Errorf("queue after the timeout: %d", n)
	}
	close(e2.local.ch("held"))
	if a := <-held; a.status != 200 {
		t.Errorf("held: %+v", a)
	}
}

// A peer's load as held counted what this node had in flight to it when
// it was taken: the estimate adds only what this node sent since, and a
// request of its own that has ended since stops counting, even while the
// report still says it runs. A new LoadSeq (an advert) starts again.
func TestRoutePeerLoadCountsMineOnce(t *testing.T) {
	p := &Proxy{router: newRouter()}
	cand := func(load, running uint32, seq uint64) []placement.Candidate {
		return []placement.Candidate{
			{Kind: placement.KindRemote, Node: "b", Load: load, LoadSeq: seq, Capacity: placement.Capacity{Slots: 4, Running: running}},
			{Kind: placement.KindRemote, Node: "c", LoadSeq: 1},
		}
	}
	inFlight := func(cs []placement.Candidate) uint32 {
		rr := &routeReq{s: &routeScratch{}}
		p.decide("chat", RouteConfig{}, cs, routing.Request{}, rr)
		return rr.s.cands[0].InFlight
	}
	tb := p.router.target("chat", "b")
	add := func() func() { tb.mine.Add(1); return func() { tb.mine.Add(-1) } }
	// Two of this node's requests run at b; b's answer to the second
	// reported 3 running (one from another consumer).
	done1 := add()
	done2 := add()
	p.router.takeReport("chat", "b", 7)
	if got := inFlight(cand(3, 3, 7)); got != 3 {
		t.Errorf("at the report: %d in flight, want 3", got)
	}
	done3 := add()
	if got := inFlight(cand(3, 3, 7)); got != 4 {
		t.Errorf("one sent since: %d, want 4", got)
	}
	done1()
	done2()
	done3()
	if got := inFlight(cand(3, 3, 7)); got != 1 {
		t.Errorf("all of this node's ended, the report still says 3: %d, want 1 (the other consumer's)", got)
	}
	// An advert that says b runs 2 arrives: it counts none of this node's.
	if got := inFlight(cand(2, 2, 8)); got != 2 {
		t.Errorf("after a new advert: %d, want 2", got)
	}
	done4 := add()
	defer done4()
	if got := inFlight(cand(2, 2, 8)); got != 3 {
		t.Errorf("one sent after the advert: %d, want 3", got)
	}
}

// A full peer's load, held longer than staleLoad with nothing of this
// node's in flight to it, leaves room for one request (whose answer
// reports afresh); with one in flight, or fresh, or not full, it counts
// as held.
func TestRoutePeerStaleFullLoadLeavesRoomForOne(t *testing.T) {
	old := staleLoad + time.Millisecond
	for _, tt := range []struct {
		held, base, mine int64
		age              time.Duration
		slots            uint32
		want             uint32
	}{
		{7, 0, 0, old, 4, 3},       // full and stale: room for one
		{7, 0, 1, old, 4, 8},       // the one sent: full again until its answer
		{7, 0, 0, staleLoad, 4, 7}, // fresh enough
		{3, 0, 0, old, 4, 3},       // not full: as held
		{7, 0, 0, old, 0, 7},       // slots unknown: as held
		{9, 2, 0, old, 4, 3},       // the others' 7, of 4 slots
		{5, 2, 0, old, 4, 3},       // the others' 3: not full
	} {
		if got := peerInFlight(tt.held, tt.base, tt.mine, tt.age, tt.slots); got != tt.want {
			t.Errorf("peerInFlight(held %d, base %d, mine %d, age %v, slots %d) = %d, want %d", tt.held, tt.base, tt.mine, tt.age, tt.slots, got, tt.want)
		}
	}
	// Through decide: b's report says full; c is busier. Once the report
	// is older than staleLoad, b is no longer full and goes first.
	p := &Proxy{router: newRouter()}
	cands := []placement.Candidate{
		{Kind: placement.KindRemote, Node: "b", Load: 6, LoadSeq: 3, Capacity: placement.Capacity{Slots: 4, Running: 4, Waiting: 2}},
		{Kind: placement.KindRemote, Node: "c", Load: 4, LoadSeq: 4, Capacity: placement.Capacity{Slots: 4, Running: 4}},
	}
	decide := func() routing.Decision {
		rr := &routeReq{s: &routeScratch{}}
		return p.decide("chat", RouteConfig{Policy: routing.PolicyAuto}, cands, routing.Request{}, rr)
	}
	if d := decide(); !d.Full || d.Order[0] != 1 {
		t.Fatalf("fresh: full %v, first %s; want full, c first", d.Full, cands[d.Order[0]].Node)
	}
	// Both loads were first seen a staleLoad ago.
	for _, n := range []string{"b", "c"} {
		tg := p.router.target("chat", n)
		tg.mu.Lock()
		tg.at = tg.at.Add(-old)
		tg.mu.Unlock()
	}
	if d := decide(); d.Full || d.Order[0] != 0 {
		t.Errorf("stale: full %v, first %s; want b first (room for one), not full", d.Full, cands[d.Order[0]].Node)
	}
}

// The local instance's load is this proxy's own count now plus what its
// engine counted beyond it; its scraped running count, up to a scrape old,
// is not read (a request that ended since would still count).
func TestRouteLocalLoadIsOwnCountPlusExternal(t *testing.T) {
	ext := int64(2)
	p := &Proxy{router: newRouter(), cfg: Config{ExternalLoad: func(string) int64 { return ext }}}
	cands := []placement.Candidate{
		{Kind: placement.KindLocal, Node: "a", Capacity: placement.Capacity{Slots: 4, Running: 4}},
		{Kind: placement.KindRemote, Node: "b", LoadSeq: 1},
	}
	local := func() routing.Cand {
		rr := &routeReq{s: &routeScratch{}}
		p.decide("chat", RouteConfig{}, cands, routing.Request{}, rr)
		return rr.s.cands[0]
	}
	done := p.busy.add("chat")
	if c := local(); c.InFlight != 3 || c.Running != 0 || c.Full() {
		t.Errorf("one of this proxy's and two external: %+v, want 3 in flight, not full", c)
	}
	done()
	ext = 0
	if c := local(); c.InFlight != 0 {
		t.Errorf("idle: %+v, want 0 in flight whatever the last scrape said", c)
	}
}
