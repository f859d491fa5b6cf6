package agent

import (
	"testing"
	"time"

	"github.com/infermesh/infermesh/proxy"
)

// The ring keeps a routed request's decision, found by role and id, in
// milliseconds; a request with one candidate has none.
func TestRecentRingKeepsRouteDecisions(t *testing.T) {
	var r recentRing
	route := &proxy.RouteInfo{Policy: "auto", Reason: "spill", Key: "prefix", Tokens: 2100,
		Candidates: []proxy.RouteCandidate{
			{Target: "b", Estimated: true, Estimate: 12 * time.Millisecond, Prefill: 10 * time.Millisecond, Network: 2 * time.Millisecond, Cached: 1984, Slots: 4, Affine: true},
			{Target: "local", Estimated: true, Estimate: time.Second, Queue: time.Second, Slots: 1, InFlight: 1, Full: true},
		}}
	r.add(proxy.Outcome{Role: "chat", RequestID: "r1", Target: "b", Status: 200, Route: route}, time.Now())
	r.add(proxy.Outcome{Role: "chat", RequestID: "r2", Target: "local", Status: 200}, time.Now())
	for i := range recentSize - 2 {
		r.add(proxy.Outcome{Role: "embed", RequestID: "x" + string(rune('a'+i%26)), Status: 200}, time.Now())
	}
	e, ok := r.find("chat", "r1")
	if !ok || e.Route == nil {
		t.Fatalf("r1: %+v, %v", e, ok)
	}
	d := e.Route
	if d.Reason != "spill" || d.Target != "b" || len(d.Candidates) != 2 || d.Candidates[0].EstimateMillis != 12 ||
		d.Candidates[0].CachedTokens != 1984 || !d.Candidates[0].Affine || !d.Candidates[1].Full || d.Candidates[1].QueueMillis != 1000 {
		t.Errorf("r1's decision: %+v", d)
	}
	if e, ok := r.find("chat", "r2"); !ok || e.Route != nil {
		t.Errorf("r2 (one candidate): %+v, %v", e, ok)
	}
	if _, ok := r.find("embed", "r1"); ok {
		t.Error("r1 found under another role")
	}
	r.add(proxy.Outcome{Role: "embed", RequestID: "y", Status: 200}, time.Now())
	if _, ok := r.find("chat", "r1"); ok {
		t.Error("r1 still found after the ring wrapped past it")
	}
}
