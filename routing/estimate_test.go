package routing_test

import (
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

const ms = time.Millisecond

func TestEstimate(t *testing.T) {
	def := routing.DefaultParams()
	tests := []struct {
		name   string
		p      routing.Params
		c      routing.Cand
		tokens int
		want   routing.Estimate
	}{
		{
			name: "idle local: nothing to wait for",
			c:    routing.Cand{Local: true, Node: "a", Slots: 4},
			want: routing.Estimate{},
		},
		{
			name: "free slot left: no queue",
			c:    routing.Cand{Node: "b", Slots: 4, InFlight: 3, Service: 800 * ms},
			want: routing.Estimate{},
		},
		{
			name: "all slots taken: waits for one of S to end",
			c:    routing.Cand{Node: "b", Slots: 4, InFlight: 4, Service: 800 * ms},
			want: routing.Estimate{Queue: 200 * ms, Total: 200 * ms, Full: true},
		},
		{
			name: "o on S: service*(o-S+1)/S",
			c:    routing.Cand{Node: "b", Slots: 4, InFlight: 6, Service: 800 * ms},
			want: routing.Estimate{Queue: 600 * ms, Total: 600 * ms, Full: true},
		},
		{
			name: "occupancy from the instance's running+waiting when larger",
			c:    routing.Cand{Node: "b", Slots: 4, InFlight: 2, Running: 4, Waiting: 2, Service: 800 * ms},
			want: routing.Estimate{Queue: 600 * ms, Total: 600 * ms, Full: true},
		},
		{
			name: "occupancy from the agent's in-flight count when larger",
			c:    routing.Cand{Node: "b", Slots: 4, InFlight: 7, Running: 1, Waiting: 1, Service: 800 * ms},
			want: routing.Estimate{Queue: 800 * ms, Total: 800 * ms, Full: true},
		},
		{
			name: "waiting alone fills the slots",
			c:    routing.Cand{Node: "b", Slots: 2, Waiting: 2, Service: 800 * ms},
			want: routing.Estimate{Queue: 400 * ms, Total: 400 * ms, Full: true},
		},
		{
			name: "unknown slots, idle: no queue, not full",
			c:    routing.Cand{Node: "b"},
			want: routing.Estimate{},
		},
		{
			name: "unknown slots count as one for the queue, never full",
			c:    routing.Cand{Node: "b", InFlight: 2, Service: 300 * ms},
			want: routing.Estimate{Queue: 600 * ms, Total: 600 * ms},
		},
		{
			name: "unmeasured service: Params default (1s)",
			c:    routing.Cand{Node: "b", Slots: 2, InFlight: 2},
			want: routing.Estimate{Queue: def.Service / 2, Total: def.Service / 2, Full: true},
		},
		{
			name: "unmeasured service: Params' own",
			p:    routing.Params{Service: 3 * time.Second},
			c:    routing.Cand{Node: "b", Slots: 2, InFlight: 2},
			want: routing.Estimate{Queue: 1500 * ms, Total: 1500 * ms, Full: true},
		},
		{
			name:   "prefill at the default cost per token (100µs)",
			c:      routing.Cand{Node: "b", Slots: 4},
			tokens: 1000,
			want:   routing.Estimate{Prefill: 1000 * def.PrefillPerToken, Total: 1000 * def.PrefillPerToken},
		},
		{
			name:   "prefill at Params' cost per token",
			p:      routing.Params{PrefillPerToken: 10 * time.Microsecond},
			c:      routing.Cand{Node: "b", Slots: 4},
			tokens: 1000,
			want:   routing.Estimate{Prefill: 10 * ms, Total: 10 * ms},
		},
		{
			name:   "prefill of the uncached tokens at the measured cost",
			c:      routing.Cand{Node: "b", Slots: 4, PrefillPerToken: 20 * time.Microsecond, CachedTokens: 400},
			tokens: 1000,
			want:   routing.Estimate{Prefill: 12 * ms, Total: 12 * ms, Cached: 400},
		},
		{
			name:   "the lowest measured cost per token is used",
			c:      routing.Cand{Node: "b", Slots: 4, PrefillPerToken: 1},
			tokens: 1000,
			want:   routing.Estimate{Prefill: 1000, Total: 1000},
		},
		{
			name:   "cached below zero clamps to zero",
			c:      routing.Cand{Node: "b", Slots: 4, PrefillPerToken: 20 * time.Microsecond, CachedTokens: -50},
			tokens: 1000,
			want:   routing.Estimate{Prefill: 20 * ms, Total: 20 * ms, Cached: 0},
		},
		{
			name:   "cached beyond the prompt clamps to the prompt",
			c:      routing.Cand{Node: "b", Slots: 4, PrefillPerToken: 20 * time.Microsecond, CachedTokens: 5000},
			tokens: 1000,
			want:   routing.Estimate{Cached: 1000},
		},
		{
			name: "round trip counted",
			c:    routing.Cand{Node: "b", Slots: 4, RTT: 3 * ms},
			want: routing.Estimate{Network: 3 * ms, Total: 3 * ms},
		},
		{
			name: "refused: default penalty (1h)",
			c:    routing.Cand{Node: "b", Slots: 4, RTT: 3 * ms, Refused: true},
			want: routing.Estimate{Network: 3 * ms, Penalty: def.Penalty, Total: def.Penalty + 3*ms},
		},
		{
			name: "cooled: Params' penalty",
			p:    routing.Params{Penalty: 10 * time.Second},
			c:    routing.Cand{Node: "b", Slots: 4, Cooled: true},
			want: routing.Estimate{Penalty: 10 * time.Second, Total: 10 * time.Second},
		},
		{
			name: "refused and cooled: one penalty",
			p:    routing.Params{Penalty: 10 * time.Second},
			c:    routing.Cand{Node: "b", Slots: 4, Cooled: true, Refused: true},
			want: routing.Estimate{Penalty: 10 * time.Second, Total: 10 * time.Second},
		},
		{
			name:   "every part summed",
			c:      routing.Cand{Node: "b", Slots: 2, InFlight: 3, Service: 400 * ms, PrefillPerToken: 50 * time.Microsecond, CachedTokens: 200, RTT: 7 * ms},
			tokens: 1200,
			// queue 400ms*2/2, prefill 1000*50µs
			want: routing.Estimate{Queue: 400 * ms, Prefill: 50 * ms, Network: 7 * ms, Total: 457 * ms, Cached: 200, Full: true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.p.Estimate(tt.c, tt.tokens); got != tt.want {
				t.Errorf("Estimate(%+v, %d)\n got %+v\nwant %+v", tt.c, tt.tokens, got, tt.want)
			}
			if got := tt.c.Full(); got != tt.want.Full {
				t.Errorf("Full() = %v, want %v", got, tt.want.Full)
			}
		})
	}
}

// Zero Params are the defaults, field by field.
func TestEstimateZeroParamsAreDefaults(t *testing.T) {
	c := routing.Cand{Node: "b", Slots: 2, InFlight: 5, RTT: 4 * ms, CachedTokens: 100, Cooled: true}
	if got, want := (routing.Params{}).Estimate(c, 900), routing.DefaultParams().Estimate(c, 900); got != want {
		t.Fatalf("zero Params %+v, defaults %+v", got, want)
	}
}

// Recent failures make the estimate worse in proportion: the parts stay,
// the total is scaled by a factor above one that does not depend on the
// parts and does not fall as failures grow.
func TestEstimateFailsScaleTotal(t *testing.T) {
	var p routing.Params
	bases := []routing.Cand{
		{Node: "b", Slots: 1, InFlight: 1, Service: 200 * ms, RTT: 2 * ms},
		{Node: "c", Slots: 4, PrefillPerToken: 30 * time.Microsecond, RTT: 9 * ms},
	}
	for _, base := range bases {
		clean := p.Estimate(base, 500)
		last := 1.0
		for f := 1; f <= 12; f++ {
			c := base
			c.Fails = f
			e := p.Estimate(c, 500)
			if e.Queue != clean.Queue || e.Prefill != clean.Prefill || e.Network != clean.Network || e.Penalty != clean.Penalty {
				t.Fatalf("%s fails=%d: parts changed: %+v vs %+v", base.Node, f, e, clean)
			}
			r := float64(e.Total) / float64(clean.Total)
			if r <= 1 || r < last {
				t.Fatalf("%s fails=%d: factor %.3f (previous %.3f)", base.Node, f, r, last)
			}
			last = r
			// Same factor for the other base: in proportion.
			o := bases[0]
			if base.Node == "b" {
				o = bases[1]
			}
			oc := o
			oc.Fails = f
			or := float64(p.Estimate(oc, 500).Total) / float64(p.Estimate(o, 500).Total)
			if d := or - r; d > 1e-6 || d < -1e-6 {
				t.Fatalf("fails=%d: factor %.6f for %s, %.6f for %s", f, r, base.Node, or, o.Node)
			}
		}
	}
	// No estimate, no failures' weight: an idle local instance stays 0.
	if e := p.Estimate(routing.Cand{Local: true, Slots: 1, Fails: 3}, 0); e.Total != 0 {
		t.Fatalf("zero estimate scaled to %v", e.Total)
	}
}

// More requests at an instance never make its estimate better, up to
// counts no instance reports (a stale or garbled one must not win).
func TestEstimateMonotoneInLoad(t *testing.T) {
	var p routing.Params
	const top = 1<<32 - 1
	loads := []uint32{0, 1, 3, 4, 5, 100, 1 << 20, 1 << 31, top - 1, top}
	for _, svc := range []time.Duration{0, 50 * ms, 10 * time.Second, time.Hour} {
		for _, fails := range []int{0, 8} {
			prev := time.Duration(-1)
			for _, o := range loads {
				for _, c := range []routing.Cand{
					{Node: "b", Slots: 4, InFlight: o, Service: svc, Fails: fails, Cooled: true},
					{Node: "b", Slots: 4, Running: o, Waiting: o, Service: svc, Fails: fails, Cooled: true},
				} {
					e := p.Estimate(c, 1000)
					if e.Total < prev || e.Total <= 0 || e.Queue < 0 {
						t.Fatalf("service %v fails %d occupancy %d (%+v): total %v after %v", svc, fails, o, c, e.Total, prev)
					}
				}
				prev = p.Estimate(routing.Cand{Node: "b", Slots: 4, InFlight: o, Service: svc, Fails: fails, Cooled: true}, 1000).Total
			}
		}
	}
	// Running+Waiting past uint32 is still full and queued.
	c := routing.Cand{Node: "b", Slots: 8, Running: top, Waiting: 2}
	if !c.Full() {
		t.Fatal("running+waiting past 2^32: not full")
	}
	if e := p.Estimate(c, 0); e.Queue < time.Hour {
		t.Fatalf("running+waiting past 2^32: queue %v", e.Queue)
	}
}
