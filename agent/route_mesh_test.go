package agent

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/proxy"
	"github.com/infermesh/infermesh/routing"
)

// The routing policy auto in a real mesh: engine-mode instances, real
// gossip and QUIC, decisions read back from the agent's decision ring.

const routeAuto = "routing: {policy: auto}"

// startLongEngine is startEngine whose answers run 2,000 tokens at 25 ms
// (50 s): a held stream keeps its slot for the whole test.
func startLongEngine(t *testing.T, model, format string, parallel int) *testUpstream {
	t.Helper()
	return startEngineTokens(t, model, format, parallel, 2000)
}

// chatResult is one request's answer through an agent.
type chatResult struct {
	status            int
	servedBy, id      string
	retryAfter, errTy string
	err               error
}

// routeChat posts a short chat (max_tokens tokens) for role to url with
// a request id of its own, and reads the whole answer.
func routeChat(ctx context.Context, url, role, id, extra string, maxTokens int) chatResult {
	body := fmt.Sprintf(`{"model":%q,"max_tokens":%d,%s"messages":[{"role":"user","content":"a short question for the router"}]}`, role, maxTokens, extra)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(proxy.RequestIDHeader, id)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return chatResult{id: id, err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	res := chatResult{status: resp.StatusCode, servedBy: resp.Header.Get(proxy.ServedByHeader), id: id, retryAfter: resp.Header.Get("Retry-After"), err: err}
	if resp.StatusCode != http.StatusOK {
		res.errTy = string(data)
	}
	return res
}

// holdOne sends one streamed chat for role to url and returns, once its
// answer has begun, the node that serves it; stop ends it.
func holdOne(t *testing.T, url, role string) (servedBy string, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+role+`","stream":true,"messages":[{"role":"user","content":"hold the slot for a while please"}]}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatalf("hold: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		cancel()
		resp.Body.Close()
		t.Fatalf("hold: status %d", resp.StatusCode)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return resp.Header.Get(proxy.ServedByHeader), stop
}

// decision is the route decision n's agent kept for request id.
func (n *meshNode) decision(t *testing.T, role, id string) (reason, target string) {
	t.Helper()
	var got string
	waitFor(t, "the decision for "+id+" in the ring", func() bool {
		e, ok := n.agent.recent.find(role, id)
		if ok && e.Route != nil {
			reason, target, got = e.Route.Reason, e.Route.Target, "yes"
		}
		return got != ""
	})
	return reason, target
}

// TestRouteAutoSpillsFromABusyLocalInstance: a serves chat from its own
// engine of one slot and b serves it too. An idle local instance is
// preferred (reason local); once a stream holds its one slot, a request
// would wait there about a second (a's instance's service time), so it
// goes to b (reason spill); once the stream ends a serves locally again.
func TestRouteAutoSpillsFromABusyLocalInstance(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ea := startLongEngine(t, "model-a", demomodel.MetricsLlamaCpp, 1)
	eb := startEngine(t, "model-b", demomodel.MetricsLlamaCpp, 4)
	a := tm.start("a", map[string]roleSpec{"chat": {upstream: ea, model: "model-a", acceptFrom: []string{"b"}, extra: routeAuto}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: eb, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to its instance and b", func() bool { return a.resolvesTo("chat", "b") && len(a.agent.Table().Resolve("chat")) == 2 })

	ctx := context.Background()
	// 40 tokens at 25 ms: a's instance takes about a second a request, as
	// a learns from this one.
	if r := routeChat(ctx, a.url("chat"), "chat", "idle-1", "", 40); r.status != 200 || r.servedBy != "a" {
		t.Fatalf("idle local instance: %+v", r)
	}
	if reason, target := a.decision(t, "chat", "idle-1"); reason != "local" || target != "local" {
		t.Errorf("idle local instance: reason %q target %q, want local", reason, target)
	}
	by, stop := holdOne(t, a.url("chat"), "chat")
	if by != "a" {
		t.Fatalf("the held stream went to %q, want a's own instance", by)
	}
	for i := range 3 {
		id := fmt.Sprintf("busy-%d", i)
		if r := routeChat(ctx, a.url("chat"), "chat", id, "", 2); r.status != 200 || r.servedBy != "b" {
			t.Fatalf("local slot held: %+v, want b", r)
		}
		if reason, target := a.decision(t, "chat", id); reason != "spill" || target != "b" {
			t.Errorf("%s: reason %q target %q, want spill to b", id, reason, target)
		}
	}
	stop()
	// a's count drops at once; its instance's scraped count when the next
	// scrape runs.
	waitFor(t, "a serves locally again once its slot is free", func() bool {
		return routeChat(ctx, a.url("chat"), "chat", "again", "", 2).servedBy == "a"
	})
}

// TestRouteAutoKeepsATenantOnItsPeer: consumers a and e, peers b and c
// (d joins later). Every request of a tenant (its prompt_cache_key) is
// served by the same peer, from either consumer, without them talking;
// the tenants are spread over the peers. Under affinity: rendezvous
// (plain rendezvous) that holds from a tenant's first request, and when d
// joins a tenant either stays or moves to d. Under the default bounded
// placement it holds once both consumers have seen the tenants (a round
// of requests, and a placement made again since: until then each places
// a newcomer against its own view),
// no peer takes more than 1.1 times its share, and when d joins
// tenants move to d and at most one of 12 between b and c (the bound
// shrinks with a third peer).
func TestRouteAutoKeepsATenantOnItsPeer(t *testing.T) {
	for _, tt := range []struct {
		name, routing string
		warm          bool
		between       int // tenants that may move between b and c when d joins
	}{
		{"rendezvous", "routing: {policy: auto, affinity: rendezvous}", false, 0},
		{"bounded", routeAuto, true, 1},
	} {
		t.Run(tt.name, func(t *testing.T) { keepsATenantOnItsPeer(t, tt.routing, tt.warm, tt.between) })
	}
}

func keepsATenantOnItsPeer(t *testing.T, routingYAML string, warm bool, between int) {
	tm := newTestMesh(t, "a", "b", "c", "d", "e")
	consumer := roleSpec{acceptFrom: []string{"b", "c", "d"}, extra: routingYAML}
	a := tm.start("a", map[string]roleSpec{"chat": consumer}, false)
	e := tm.start("e", map[string]roleSpec{"chat": consumer}, false)
	for _, p := range []string{"b", "c"} {
		tm.start(p, map[string]roleSpec{"chat": {upstream: startEngine(t, "model-"+p, demomodel.MetricsVLLM, 4), model: "model-" + p, expose: true, serveTo: []string{"a", "e"}}}, false)
	}
	waitFor(t, "a and e resolve chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") && e.resolvesTo("chat", "b", "c") })

	const tenants = 12
	placeAll := func(round string, check bool) map[string]string {
		t.Helper()
		where := map[string]string{}
		for tn := range tenants {
			key := fmt.Sprintf(`"prompt_cache_key":"tenant-%d",`, tn)
			for i, n := range []*meshNode{a, e, a, e} {
				id := fmt.Sprintf("%s-t%d-%d", round, tn, i)
				r := routeChat(context.Background(), n.url("chat"), "chat", id, key, 2)
				if r.status != 200 {
					t.Fatalf("%s: %+v", id, r)
				}
				if !check {
					continue
				}
				if prev, ok := where[fmt.Sprint(tn)]; ok && prev != r.servedBy {
					t.Errorf("tenant %d: served by %s and by %s (%s through %s)", tn, prev, r.servedBy, id, n.name)
				}
				where[fmt.Sprint(tn)] = r.servedBy
				if reason, _ := n.decision(t, "chat", id); reason != "affinity" {
					t.Errorf("%s through %s: reason %q, want affinity", id, n.name, reason)
				}
			}
		}
		return where
	}
	// Under the bounded placement a consumer places a key new to it at
	// once against its current view, and all of them again every
	// routing.PlaceEvery: once that passed after the last new key, both
	// consumers hold the same keys and place them alike. The sleep is
	// the condition itself, not a guess at a speed: a placement is made
	// again on the first request at least PlaceEvery after the last, so
	// once PlaceEvery has passed the next request of each consumer places
	// every key from the same set, however loaded the machine. (Polling
	// with requests instead would add weight to the polled tenant.)
	settle := func(round string) {
		if warm {
			placeAll(round, false)
			time.Sleep(routing.PlaceEvery)
		}
	}
	settle("warm-two")
	before := placeAll("two", true)
	count := map[string]int{}
	for _, p := range before {
		count[p]++
	}
	if count["b"] == 0 || count["c"] == 0 || (warm && max(count["b"], count["c"]) > tenants/2*11/10) {
		t.Errorf("12 tenants over b and c: %v", count)
	}

	tm.start("d", map[string]roleSpec{"chat": {upstream: startEngine(t, "model-d", demomodel.MetricsVLLM, 4), model: "model-d", expose: true, serveTo: []string{"a", "e"}}}, false)
	waitFor(t, "a and e resolve chat to b, c and d", func() bool {
		return a.resolvesTo("chat", "b", "c", "d") && e.resolvesTo("chat", "b", "c", "d")
	})
	settle("warm-three")
	after := placeAll("three", true)
	moved, across := 0, 0
	for tn, p := range after {
		if p != before[tn] {
			moved++
			if p != "d" {
				across++
				t.Logf("tenant %s moved from %s to %s when d joined", tn, before[tn], p)
			}
		}
	}
	if across > between {
		t.Errorf("%d tenants moved between b and c when d joined, want at most %d", across, between)
	}
	if moved == 0 {
		t.Errorf("no tenant of 12 moved to d: %v", after)
	}
}

// TestRouteAutoQueuesWhenEveryPeerIsFull: consumer a holds requests
// (routing.queue.max 2) while its peers b and c, one slot each, are
// busy. The queue refuses a third with 503 server_busy and Retry-After;
// a queued request whose client goes away leaves at once; a freed slot
// takes the head of the queue first; the queue drains.
func TestRouteAutoQueuesWhenEveryPeerIsFull(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}, extra: "routing: {policy: auto, queue: {max: 2, timeout: 60s}}"}}, false)
	for _, p := range []string{"b", "c"} {
		tm.start(p, map[string]roleSpec{"chat": {upstream: startLongEngine(t, "model-"+p, demomodel.MetricsLlamaCpp, 1), model: "model-" + p, expose: true, serveTo: []string{"a"}}}, false)
	}
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })

	holds := map[string]func(){}
	for range 2 {
		by, stop := holdOne(t, a.url("chat"), "chat")
		if holds[by] != nil || (by != "b" && by != "c") {
			t.Fatalf("held streams served by %q twice or by neither peer", by)
		}
		holds[by] = stop
	}
	waitFor(t, "a knows b and c are full: one slot each, one running", func() bool {
		cb, cc := remoteCapacity(a, "chat", "b"), remoteCapacity(a, "chat", "c")
		return cb.Slots == 1 && cb.Running == 1 && cc.Slots == 1 && cc.Running == 1
	})
	queueLen := func() int { return a.agent.proxy.QueueLen("chat") }

	results := make(chan chatResult, 4)
	send := func(ctx context.Context, id string, tokens int) {
		go func() { results <- routeChat(ctx, a.url("chat"), "chat", id, "", tokens) }()
	}
	send(context.Background(), "first", 2)
	waitFor(t, "first queued", func() bool { return queueLen() == 1 })
	gone, cancel := context.WithCancel(context.Background())
	send(gone, "gone", 2)
	waitFor(t, "gone queued behind first", func() bool { return queueLen() == 2 })

	r := routeChat(context.Background(), a.url("chat"), "chat", "refused", "", 2)
	if r.status != http.StatusServiceUnavailable || r.retryAfter == "" || !strings.Contains(r.errTy, "server_busy") {
		t.Errorf("a third request with two queued: %+v, want 503 server_busy with Retry-After", r)
	}
	cancel()
	waitFor(t, "a cancelled request leaves the queue", func() bool { return queueLen() == 1 })
	if r := <-results; r.id != "gone" || r.err == nil {
		t.Errorf("the cancelled request: %+v", r)
	}
	send(context.Background(), "second", 20)
	waitFor(t, "second queued behind first", func() bool { return queueLen() == 2 })

	// One slot frees: the head of the queue takes it; second waits on.
	holds["b"]()
	r = <-results
	if r.id != "first" || r.status != 200 || r.servedBy != "b" {
		t.Fatalf("the freed slot took %+v, want first served by b", r)
	}
	if reason, _ := a.decision(t, "chat", "first"); reason != "queued" {
		t.Errorf("first's reason %q, want queued", reason)
	}
	r = <-results
	if r.id != "second" || r.status != 200 {
		t.Fatalf("the queue drained with %+v, want second served", r)
	}
	if n := queueLen(); n != 0 {
		t.Errorf("queue length %d after it drained", n)
	}
}
