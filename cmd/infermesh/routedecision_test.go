package main

import (
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
)

func TestRenderRouteDecision(t *testing.T) {
	out := renderRouteDecision(admin.RouteDecision{ID: "r1", Role: "chat", Policy: "auto", Reason: "spill", Key: "prefix",
		Tokens: 2100, QueuedMillis: 3.5, Target: "b", Status: 200, Candidates: []admin.RouteEstimate{
			{Target: "b", Estimated: true, EstimateMillis: 12, PrefillMillis: 10, NetworkMillis: 2, CachedTokens: 1984, Slots: 4, Affine: true},
			{Target: "local", Estimated: true, EstimateMillis: 1000, QueueMillis: 1000, InFlight: 1, Slots: 1, Full: true},
			{Target: "c", Estimated: true, EstimateMillis: 3600000, PenaltyMillis: 3600000},
		}})
	for _, want := range []string{
		"request r1 (role chat): served by b (status 200), policy auto, reason spill",
		"prompt ~2100 tokens, affinity key: prefix, queued 3.5ms",
		"b          12.0ms",
		"1984    0/4       (affine) <- answered",
		"1/1 full",
		"(penalized)",
		"0/?",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in\n%s", want, out)
		}
	}
}
