package agent

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
)

// startEngine serves the demo model's engine mode (parallel slots, its
// metrics in format; answers of 400 tokens at 25 ms) and returns it as a
// test upstream.
func startEngine(t *testing.T, model, format string, parallel int) *testUpstream {
	t.Helper()
	return startEngineTokens(t, model, format, parallel, 400)
}

// startEngineTokens is startEngine whose answers run tokens tokens.
func startEngineTokens(t *testing.T, model, format string, parallel, tokens int) *testUpstream {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model, cfg.Parallel, cfg.Metrics, cfg.CacheTokens, cfg.CacheBlock = model, parallel, format, 4096, 4
	cfg.DecodePerToken, cfg.TokenDelay, cfg.Tokens = 25*time.Millisecond, 25*time.Millisecond, tokens
	m, err := demomodel.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: m, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return &testUpstream{base: "http://" + ln.Addr().String()}
}

// holdChats sends n streamed chat requests for role to url and keeps them open
// until the returned stop is called.
func holdChats(t *testing.T, url, role string, n int) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions",
				strings.NewReader(`{"model":"`+role+`","stream":true,"messages":[{"role":"user","content":"hold the slot for a while please"}]}`))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	return func() { cancel(); wg.Wait() }
}

func remoteCapacity(n *meshNode, role, node string) placement.Capacity {
	for _, c := range n.agent.Table().Resolve(role) {
		if c.Kind == placement.KindRemote && c.Node == node {
			return c.Capacity
		}
	}
	return placement.Capacity{}
}

// TestCapacityFromEngineMetricsReachesPeers: b serves chat from an engine
// of 2 slots exporting llama.cpp's metrics (found by auto). With 3 streams
// from a's apps held open, b reads 2 running, 1 waiting, its 2 slots
// (/slots) and its KV cache in use, and a holds that in b's advert; once
// they end, a sees b idle again. c's instance exports no metrics (metrics:
// none) and has capacity 1: its own count stands in (1 running, 1
// waiting with 2 streams).
func TestCapacityFromEngineMetricsReachesPeers(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	eb := startEngine(t, "model-b", demomodel.MetricsLlamaCpp, 2)
	ec := startEngine(t, "model-c", demomodel.MetricsNone, 1)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}, "embed": {acceptFrom: []string{"c"}}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: eb, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"embed": {upstream: ec, model: "model-c", expose: true, serveTo: []string{"a"}, extra: "metrics: none\n    capacity: 1"}}, false)
	waitFor(t, "a resolves chat to b and embed to c", func() bool { return a.resolvesTo("chat", "b") && a.resolvesTo("embed", "c") })

	stop := holdChats(t, a.url("chat"), "chat", 3)
	waitFor(t, "a holds b's capacity: 2 slots holding 4096 tokens of context (its KV cache), 2 running, 1 waiting, cache in use", func() bool {
		c := remoteCapacity(a, "chat", "b")
		return c.Slots == 2 && c.CacheTokens == 4096 && c.Running == 2 && c.Waiting == 1 && c.KVUsage > 0
	})
	if got := b.agent.Table().Snapshot().LocalCap["chat"]; got.Slots != 2 {
		t.Errorf("b's own record of its capacity: %+v", got)
	}
	stop()
	waitFor(t, "a sees b idle once the streams ended", func() bool {
		c := remoteCapacity(a, "chat", "b")
		return c.Slots == 2 && c.Running == 0 && c.Waiting == 0
	})

	stop = holdChats(t, a.url("embed"), "embed", 2)
	defer stop()
	waitFor(t, "a holds c's capacity from c's own count: 1 slot, 1 running, 1 waiting", func() bool {
		c := remoteCapacity(a, "embed", "c")
		return c.Slots == 1 && c.Running == 1 && c.Waiting == 1 && c.KVUsage == 0
	})
}

// TestCapacitySlotsReadOffVLLM: vLLM's metrics name no slot count. b's
// engine (vLLM's names, 2 slots) has 3 streams held: one waits while 2 run,
// so b takes 2 as its slots and a holds that in b's advert.
func TestCapacitySlotsReadOffVLLM(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	eb := startEngine(t, "model-b", demomodel.MetricsVLLM, 2)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: eb, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	stop := holdChats(t, a.url("chat"), "chat", 1)
	waitFor(t, "b runs one, slots unknown", func() bool {
		c := remoteCapacity(a, "chat", "b")
		return c.Running == 1 && c.Waiting == 0
	})
	if c := remoteCapacity(a, "chat", "b"); c.Slots != 0 {
		t.Errorf("with nothing waiting b claims %d slots", c.Slots)
	}
	stop()
	stop = holdChats(t, a.url("chat"), "chat", 3)
	defer stop()
	waitFor(t, "a holds b's 2 slots, read off 2 running and 1 waiting", func() bool {
		c := remoteCapacity(a, "chat", "b")
		return c.Slots == 2 && c.Running == 2 && c.Waiting == 1
	})
}

// TestCacheHitRatioOfTheLocalInstance: a serves chat from a vLLM-mode
// engine; after the same long prompt several times, `route` shows the
// instance's prefix cache hit ratio (its counters, in tokens), between 0
// and 1 and above 0, for the role and in the local candidate's capacity;
// the role's queue is 0.
func TestCacheHitRatioOfTheLocalInstance(t *testing.T) {
	tm := newTestMesh(t, "a")
	ea := startEngineTokens(t, "model-a", demomodel.MetricsVLLM, 2, 2)
	a := tm.start("a", map[string]roleSpec{"chat": {upstream: ea, model: "model-a"}}, false)
	rt := routeOnceHit(t, a, "a")
	if r := *rt.CacheHitRatio; r > 1 || rt.Queue != 0 {
		t.Errorf("route: cache hit ratio %v, queue %d; want at most 1 and 0", r, rt.Queue)
	}
}

// TestCacheHitRatioOfAPeer: b serves chat to a from a vLLM-mode engine; a
// has no instance of its own. After the same long prompt several times
// through a, a's `route` shows b's prefix cache hit ratio in b's capacity
// (b's load reports and adverts carry it), and no ratio of a local
// instance.
func TestCacheHitRatioOfAPeer(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	eb := startEngineTokens(t, "model-b", demomodel.MetricsVLLM, 2, 2)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: eb, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	rt := routeOnceHit(t, a, "b")
	if rt.CacheHitRatio != nil {
		t.Errorf("a has no instance, yet its route shows a local hit ratio %v", *rt.CacheHitRatio)
	}
}

// routeOnceHit sends n's chat port the same long prompt until n's route
// shows node's instance with a prefix cache hit ratio above 0 (at most 1),
// and returns that route.
func routeOnceHit(t *testing.T, n *meshNode, node string) admin.Route {
	t.Helper()
	be := n.agent.admin.Backend()
	body := `{"model":"chat","messages":[{"role":"system","content":"` + strings.Repeat("You are a careful assistant. ", 200) + `"},{"role":"user","content":"hi"}]}`
	var rt admin.Route
	waitFor(t, "the route shows "+node+"'s instance with a cache hit ratio above 0", func() bool {
		resp, err := http.Post(n.url("chat")+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
		case http.StatusServiceUnavailable:
			return false // the instance is not a candidate yet (the agent's first health check)
		default:
			t.Fatalf("chat = %d", resp.StatusCode)
		}
		if rt, err = be.Route(context.Background(), "chat"); err != nil {
			t.Fatal(err)
		}
		for _, d := range rt.Decisions {
			if d.Node == node && d.Capacity != nil && d.Capacity.CacheHitRatio != nil {
				r := *d.Capacity.CacheHitRatio
				if r > 1 {
					t.Fatalf("%s's cache hit ratio %v", node, r)
				}
				return r > 0
			}
		}
		return false
	})
	return rt
}
