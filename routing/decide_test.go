package routing_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

// names is the candidates' names in order, the local one marked "*".
func names(cands []routing.Cand, order []int) string {
	s := make([]string, len(order))
	for i, ci := range order {
		s[i] = cands[ci].Node
		if cands[ci].Local {
			s[i] += "*"
		}
	}
	return strings.Join(s, ",")
}

// winner is key's rendezvous peer among nodes, computed from the scores.
func winner(key uint64, nodes ...string) string {
	best, bs := "", uint64(0)
	for _, n := range nodes {
		if s := routing.Rendezvous(key, n); best == "" || s > bs {
			best, bs = n, s
		}
	}
	return best
}

// keyFor is a key whose rendezvous peer among nodes is want.
func keyFor(t testing.TB, want string, nodes ...string) uint64 {
	t.Helper()
	for k := uint64(1); k < 1000; k++ {
		if winner(k, nodes...) == want {
			return k
		}
	}
	t.Fatalf("no key for %s among %v", want, nodes)
	return 0
}

func index(cands []routing.Cand, node string) int {
	return slices.IndexFunc(cands, func(c routing.Cand) bool { return c.Node == node })
}

func decide(policy routing.Policy, cands []routing.Cand, req routing.Request) routing.Decision {
	return routing.Decide(policy, cands, req, routing.Params{}, nil, nil)
}

// Default params: AbsMargin 50ms, RelMargin 1.5, Service 1s, 100µs/token.
var (
	// Local, every slot taken and more: queue 1s*(8-4+1)/4 = 1.25s.
	saturatedLocal = routing.Cand{Local: true, Node: "a", Slots: 4, InFlight: 8}
	idleLocal      = routing.Cand{Local: true, Node: "a", Slots: 4}
	idleB          = routing.Cand{Node: "b", Slots: 4, RTT: 2 * ms}
	idleC          = routing.Cand{Node: "c", Slots: 4, InFlight: 2, RTT: 5 * ms}
)

// busy is a candidate whose estimate is exactly d (for a prompt of no
// tokens): one request on one slot that takes d.
func busy(node string, d time.Duration) routing.Cand {
	return routing.Cand{Node: node, Slots: 1, InFlight: 1, Service: d}
}

// at is an idle peer whose estimate is exactly d: its round trip.
func at(node string, d time.Duration) routing.Cand {
	return routing.Cand{Node: node, Slots: 4, RTT: d}
}

func TestDecideAuto(t *testing.T) {
	keyB := keyFor(t, "b", "b", "c")
	keyC := keyFor(t, "c", "b", "c")
	localBusy := func(d time.Duration) routing.Cand { c := busy("a", d); c.Local = true; return c }
	cached := func(c routing.Cand, tokens int) routing.Cand { c.CachedTokens = tokens; return c }
	tests := []struct {
		name   string
		cands  []routing.Cand
		req    routing.Request
		order  string
		reason routing.Reason
		affine string // "" none
	}{
		{
			name:   "saturated local, idle peer: spill",
			cands:  []routing.Cand{saturatedLocal, idleB},
			req:    routing.Request{Tokens: 1000},
			order:  "b,a*",
			reason: routing.ReasonSpill,
		},
		{
			name:   "saturated local, idle peer that is the key's: affinity",
			cands:  []routing.Cand{saturatedLocal, idleB},
			req:    routing.Request{Tokens: 1000, Key: keyB},
			order:  "b,a*",
			reason: routing.ReasonAffinity,
			affine: "b",
		},
		{
			name:   "saturated local, two peers, no key: the best",
			cands:  []routing.Cand{saturatedLocal, idleC, idleB},
			req:    routing.Request{Tokens: 1000},
			order:  "b,c,a*",
			reason: routing.ReasonSpill,
		},
		{
			name:   "saturated local, the key's peer within the margin of the best: affinity",
			cands:  []routing.Cand{saturatedLocal, idleC, idleB},
			req:    routing.Request{Tokens: 1000, Key: keyC},
			order:  "c,b,a*",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name:   "no local, no key: the best",
			cands:  []routing.Cand{idleC, idleB},
			req:    routing.Request{Tokens: 1000},
			order:  "b,c",
			reason: routing.ReasonLeastTTFT,
		},
		{
			name: "local within the margin of a better peer: kept",
			cands: []routing.Cand{
				{Local: true, Node: "a", Slots: 4},                    // 100ms prefill
				{Node: "b", Slots: 4, CachedTokens: 420, RTT: 2 * ms}, // 58ms + 2ms
			},
			req:    routing.Request{Tokens: 1000},
			order:  "a*,b",
			reason: routing.ReasonLocal,
		},
		{
			name: "local beyond both margins of a better peer: spill",
			cands: []routing.Cand{
				{Local: true, Node: "a", Slots: 4},                    // 100ms
				{Node: "b", Slots: 4, CachedTokens: 600, RTT: 2 * ms}, // 42ms: +58ms, x2.4
			},
			req:    routing.Request{Tokens: 1000},
			order:  "b,a*",
			reason: routing.ReasonSpill,
		},
		{
			name:   "local at exactly the absolute margin: kept",
			cands:  []routing.Cand{at("b", 10*ms), localBusy(60 * ms)},
			order:  "a*,b",
			reason: routing.ReasonLocal,
		},
		{
			name:   "local a nanosecond past the absolute margin (and the relative): spill",
			cands:  []routing.Cand{at("b", 10*ms), localBusy(60*ms + 1)},
			order:  "b,a*",
			reason: routing.ReasonSpill,
		},
		{
			name:   "local past the absolute margin, at exactly the relative one: kept",
			cands:  []routing.Cand{at("b", 200*ms), localBusy(300 * ms)},
			order:  "a*,b",
			reason: routing.ReasonLocal,
		},
		{
			name:   "local past both by a nanosecond: spill",
			cands:  []routing.Cand{at("b", 200*ms), localBusy(300*ms + 1)},
			order:  "b,a*",
			reason: routing.ReasonSpill,
		},
		{
			name:   "local within the margin, holding nothing of the prompt, leaves it to the key's peer",
			cands:  []routing.Cand{localBusy(40 * ms), at("b", 1*ms), at("c", 1*ms)},
			req:    routing.Request{Key: keyC},
			order:  "c,b,a*",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name:   "local within the margin, holding as much as the key's peer, wins",
			cands:  []routing.Cand{cached(localBusy(40*ms), 640), at("b", 1*ms), cached(at("c", 1*ms), 640)},
			req:    routing.Request{Key: keyC, Tokens: 700},
			order:  "a*,c,b",
			reason: routing.ReasonLocal,
			affine: "c",
		},
		{
			name:   "local within the margin, the key's peer outside it: local",
			cands:  []routing.Cand{localBusy(40 * ms), at("b", 1*ms), busy("c", 900*ms)},
			req:    routing.Request{Key: keyC},
			order:  "a*,b,c",
			reason: routing.ReasonLocal,
			affine: "c",
		},
		{
			name:   "affine peer at exactly the absolute margin: kept",
			cands:  []routing.Cand{at("b", 10*ms), busy("c", 60*ms)},
			req:    routing.Request{Key: keyC},
			order:  "c,b",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name:   "affine peer past the absolute margin, within the relative: kept",
			cands:  []routing.Cand{at("b", 200*ms), busy("c", 300*ms)},
			req:    routing.Request{Key: keyC},
			order:  "c,b",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name:   "affine peer past both margins: left for the best",
			cands:  []routing.Cand{at("b", 200*ms), busy("c", 300*ms+1)},
			req:    routing.Request{Key: keyC},
			order:  "b,c",
			reason: routing.ReasonLeastTTFT,
			affine: "c",
		},
		{
			name:   "affine peer past both margins, saturated local: spill to the best",
			cands:  []routing.Cand{saturatedLocal, at("b", 10*ms), busy("c", 70*ms)},
			req:    routing.Request{Key: keyC},
			order:  "b,c,a*",
			reason: routing.ReasonSpill,
			affine: "c",
		},
		{
			name: "heavy report (in flight) makes the key's peer worse",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, InFlight: 10, RTT: 1 * ms}, // 1s*7/4
				{Node: "c", Slots: 4, RTT: 3 * ms},
			},
			req:    routing.Request{Tokens: 500, Key: keyB},
			order:  "c,b",
			reason: routing.ReasonLeastTTFT,
			affine: "b",
		},
		{
			name: "heavy report (running and waiting) makes a peer worse",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Running: 4, Waiting: 6, RTT: 1 * ms},
				{Node: "c", Slots: 4, RTT: 3 * ms},
			},
			req:    routing.Request{Tokens: 500},
			order:  "c,b",
			reason: routing.ReasonLeastTTFT,
		},
		{
			name: "same peers, light report: the nearer",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Running: 1, RTT: 1 * ms},
				{Node: "c", Slots: 4, RTT: 3 * ms},
			},
			req:    routing.Request{Tokens: 500},
			order:  "b,c",
			reason: routing.ReasonLeastTTFT,
		},
		{
			name: "refused and cooled peers go last, even after a saturated local",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Refused: true},
				{Node: "c", Slots: 4, Cooled: true, RTT: 1 * ms},
				saturatedLocal,
				{Node: "d", Slots: 4, InFlight: 40}, // 9.25s queue
			},
			req:    routing.Request{Tokens: 100},
			order:  "a*,d,b,c",
			reason: routing.ReasonLocal,
		},
		{
			name: "refused peer is never the key's, even when it would win the key",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Refused: true},
				at("c", 30*ms),
			},
			req:    routing.Request{Key: keyB},
			order:  "c,b",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name: "cooled peer is never the key's",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Cooled: true},
				at("c", 30*ms),
			},
			req:    routing.Request{Key: keyB},
			order:  "c,b",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name: "every peer refused or cooled: no affine one",
			cands: []routing.Cand{
				{Node: "b", Slots: 4, Cooled: true},
				{Node: "c", Slots: 4, Refused: true},
				saturatedLocal,
			},
			req:    routing.Request{Key: keyB},
			order:  "a*,b,c",
			reason: routing.ReasonLocal,
		},
		{
			name: "the local instance is never the key's",
			cands: []routing.Cand{
				{Local: true, Node: "b", Slots: 4, InFlight: 40},
				at("c", 5*ms),
			},
			req:    routing.Request{Key: keyB},
			order:  "c,b*",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
		{
			name: "ties: the local instance, then by node",
			cands: []routing.Cand{
				at("d", 0), at("b", 0), {Local: true, Node: "z", Slots: 4}, at("c", 0),
			},
			order:  "z*,b,c,d",
			reason: routing.ReasonLocal,
		},
		{
			name: "ties in the failover after a spill: the local instance first",
			cands: []routing.Cand{
				busy("c", 100*ms), at("b", 10*ms), func() routing.Cand { c := localBusy(100 * ms); c.Node = "z"; return c }(),
			},
			order:  "b,z*,c",
			reason: routing.ReasonSpill,
		},
		{
			name:   "ties without a local instance: by node",
			cands:  []routing.Cand{at("d", 4*ms), at("c", 4*ms), at("b", 4*ms)},
			order:  "b,c,d",
			reason: routing.ReasonLeastTTFT,
		},
		{
			name: "failover after a kept local instance: by estimate",
			cands: []routing.Cand{
				at("e", 30*ms), at("b", 9*ms), localBusy(40 * ms), at("d", 1*ms), at("c", 20*ms),
			},
			order:  "a*,d,b,c,e",
			reason: routing.ReasonLocal,
		},
		{
			name: "failover after the key's peer: by estimate",
			cands: []routing.Cand{
				at("e", 30*ms), at("b", 9*ms), saturatedLocal, at("d", 1*ms), at("c", 20*ms),
			},
			req:    routing.Request{Key: keyFor(t, "c", "b", "c", "d", "e")},
			order:  "c,d,b,e,a*",
			reason: routing.ReasonAffinity,
			affine: "c",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := decide(routing.PolicyAuto, tt.cands, tt.req)
			if got := names(tt.cands, d.Order); got != tt.order || d.Reason != tt.reason {
				t.Errorf("order %s (%s), want %s (%s)\nestimates %+v", got, d.Reason, tt.order, tt.reason, d.Estimates)
			}
			want := -1
			if tt.affine != "" {
				want = index(tt.cands, tt.affine)
			}
			if d.Affine != want {
				t.Errorf("affine %d, want %d (%s)", d.Affine, want, tt.affine)
			}
			if len(d.Estimates) != len(tt.cands) {
				t.Fatalf("%d estimates for %d candidates", len(d.Estimates), len(tt.cands))
			}
			for i := range tt.cands {
				if e := routing.DefaultParams().Estimate(tt.cands[i], tt.req.Tokens); d.Estimates[i] != e {
					t.Errorf("estimate %d: %+v, want %+v", i, d.Estimates[i], e)
				}
			}
		})
	}
}

// Refused and cooled peers are never affine, whatever the key.
func TestDecideNeverAffineRefusedOrCooled(t *testing.T) {
	cands := []routing.Cand{
		{Node: "b", Slots: 4, Refused: true},
		{Node: "c", Slots: 4},
		{Node: "d", Slots: 4, Cooled: true},
		{Node: "e", Slots: 4},
		{Local: true, Node: "a", Slots: 4},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		k := r.Uint64() | 1
		d := decide(routing.PolicyAuto, cands, routing.Request{Key: k})
		if got, want := cands[d.Affine].Node, winner(k, "c", "e"); got != want {
			t.Fatalf("key %#x: affine %s, want %s", k, got, want)
		}
	}
}

func TestDecideFull(t *testing.T) {
	full := []routing.Cand{
		{Local: true, Node: "a", Slots: 2, InFlight: 2},
		{Node: "b", Slots: 4, Running: 4},
		{Node: "c", Slots: 1, Waiting: 3},
	}
	free := append(slices.Clone(full), routing.Cand{Node: "d", Slots: 4, InFlight: 3})
	unknown := append(slices.Clone(full), routing.Cand{Node: "d", InFlight: 100})
	for _, pol := range []routing.Policy{routing.PolicyAuto, routing.PolicyLocalFirst, routing.PolicyLeastLoaded} {
		t.Run(pol.String(), func(t *testing.T) {
			for _, tt := range []struct {
				name  string
				cands []routing.Cand
				want  bool
			}{
				{"every slot taken", full, true},
				{"one free slot", free, false},
				{"one with unknown slots", unknown, false},
				{"one, full", full[1:2], true},
				{"one, free", free[3:], false},
				{"one, unknown slots", unknown[3:], false},
			} {
				if d := decide(pol, tt.cands, routing.Request{Tokens: 10}); d.Full != tt.want {
					t.Errorf("%s: Full %v, want %v", tt.name, d.Full, tt.want)
				}
			}
		})
	}
}

func TestDecideSingle(t *testing.T) {
	for _, pol := range []routing.Policy{routing.PolicyAuto, routing.PolicyLocalFirst, routing.PolicyLeastLoaded} {
		for _, c := range []routing.Cand{idleLocal, saturatedLocal, {Node: "b", Refused: true, InFlight: 9}} {
			d := decide(pol, []routing.Cand{c}, routing.Request{Tokens: 100, Key: 7})
			if !slices.Equal(d.Order, []int{0}) || d.Reason != routing.ReasonOnly || d.Estimates != nil || d.Affine != -1 {
				t.Errorf("%s %+v: %+v", pol, c, d)
			}
			if d.Full != c.Full() {
				t.Errorf("%s %+v: Full %v", pol, c, d.Full)
			}
		}
	}
	if d := decide(routing.PolicyAuto, nil, routing.Request{}); len(d.Order) != 0 || d.Affine != -1 {
		t.Errorf("no candidates: %+v", d)
	}
}

func TestDecideLocalFirst(t *testing.T) {
	key := keyFor(t, "b", "b", "c")
	tests := []struct {
		name   string
		cands  []routing.Cand
		reason routing.Reason
	}{
		{"local first, however busy", []routing.Cand{saturatedLocal, {Node: "c", Slots: 4, InFlight: 9}, idleB}, routing.ReasonLocal},
		{"local first, a refused peer before an idle one", []routing.Cand{saturatedLocal, {Node: "c", Refused: true}, idleB}, routing.ReasonLocal},
		{"no local instance: the caller's order", []routing.Cand{{Node: "c", Slots: 4, InFlight: 9}, idleB}, routing.ReasonOrder},
		{"local not first: the caller's order", []routing.Cand{idleB, idleLocal}, routing.ReasonOrder},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := decide(routing.PolicyLocalFirst, tt.cands, routing.Request{Tokens: 1000, Key: key})
			want := make([]int, len(tt.cands))
			for i := range want {
				want[i] = i
			}
			if !slices.Equal(d.Order, want) || d.Reason != tt.reason {
				t.Errorf("order %v (%s), want %v (%s)", d.Order, d.Reason, want, tt.reason)
			}
			if d.Estimates != nil || d.Affine != -1 {
				t.Errorf("estimates %v affine %d: want none", d.Estimates, d.Affine)
			}
		})
	}
}

func TestDecideLeastLoaded(t *testing.T) {
	cands := []routing.Cand{
		{Local: true, Node: "a", Slots: 4, InFlight: 3},          // .75
		{Node: "b", Slots: 2, Running: 1, CachedTokens: 1000},    // .5, cache ignored
		{Node: "c", InFlight: 1},                                 // 1 (unknown slots: one)
		{Node: "d", Slots: 8, RTT: 90 * ms},                      // 0, distance ignored
		{Node: "e", Slots: 4, Refused: true},                     // idle, refused: last
		{Node: "f", Slots: 4, Running: 1, Waiting: 2},            // .75, after a (input order)
		{Node: "g", Slots: 4, Cooled: true},                      // idle, cooled: last
		{Node: "h", Slots: 2, InFlight: 9, CachedTokens: 100000}, // 4.5
	}
	d := decide(routing.PolicyLeastLoaded, cands, routing.Request{Tokens: 1000, Key: keyFor(t, "b", "b", "c", "d", "f", "h")})
	if got, want := names(cands, d.Order), "d,b,a*,f,c,h,e,g"; got != want || d.Reason != routing.ReasonLeastLoaded {
		t.Errorf("order %s (%s), want %s (least-loaded)", got, d.Reason, want)
	}
	if len(d.Estimates) != len(cands) || d.Affine != -1 {
		t.Errorf("estimates %d, affine %d", len(d.Estimates), d.Affine)
	}
}

// Decide answers in the slices it is given, without allocating.
func TestDecideReusesSlices(t *testing.T) {
	cands := benchCands(8)
	order, ests := make([]int, 0, 8), make([]routing.Estimate, 0, 8)
	req := routing.Request{Tokens: 1200, Key: 0xfeed}
	for _, pol := range []routing.Policy{routing.PolicyAuto, routing.PolicyLeastLoaded, routing.PolicyLocalFirst} {
		d := routing.Decide(pol, cands, req, routing.Params{}, order, ests)
		if &d.Order[0] != &order[:1][0] || d.Estimates != nil && &d.Estimates[0] != &ests[:1][0] {
			t.Errorf("%s: answer not in the given slices", pol)
		}
		if n := testing.AllocsPerRun(100, func() {
			d = routing.Decide(pol, cands, req, routing.Params{}, order, ests)
		}); n != 0 {
			t.Errorf("%s: %v allocations", pol, n)
		}
	}
}

// For random candidates, the rules hold: the order is a permutation, the
// first is whom the reason names, and the rest are by estimate.
func TestDecideAutoProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	p := routing.DefaultParams()
	var order []int
	var ests []routing.Estimate
	for iter := range 5000 {
		n := 2 + r.IntN(7)
		cands := make([]routing.Cand, n)
		for i := range cands {
			c := routing.Cand{Node: fmt.Sprintf("n%d", r.IntN(1000)), Slots: uint32(r.IntN(5)),
				InFlight: uint32(r.IntN(8)), Running: uint32(r.IntN(4)), Waiting: uint32(r.IntN(3)),
				RTT:          time.Duration(r.IntN(40)) * ms,
				CachedTokens: r.IntN(3000), Refused: r.IntN(10) == 0, Cooled: r.IntN(10) == 0, Fails: r.IntN(3) * r.IntN(2)}
			if r.IntN(2) == 0 {
				c.Service = time.Duration(50+r.IntN(2000)) * ms
			}
			if r.IntN(2) == 0 {
				c.PrefillPerToken = time.Duration(20+r.IntN(200)) * time.Microsecond
			}
			cands[i] = c
		}
		if r.IntN(2) == 0 {
			cands[0].Local, cands[0].RTT, cands[0].Refused, cands[0].Cooled = true, 0, false, false
			cands[0], cands[n-1] = cands[n-1], cands[0]
		}
		req := routing.Request{Tokens: r.IntN(4000)}
		if r.IntN(3) > 0 {
			req.Key = r.Uint64() | 1
		}
		d := routing.Decide(routing.PolicyAuto, cands, req, routing.Params{}, order, ests)
		order, ests = d.Order, d.Estimates
		fail := func(f string, a ...any) {
			t.Helper()
			t.Fatalf("iteration %d: %s\ncands %+v\nreq %+v\ndecision %+v", iter, fmt.Sprintf(f, a...), cands, req, d)
		}
		if s := slices.Sorted(slices.Values(d.Order)); len(s) != n || s[0] != 0 || s[n-1] != n-1 || len(slices.Compact(s)) != n {
			fail("order not a permutation")
		}
		tot := func(i int) time.Duration { return d.Estimates[i].Total }
		for k := 2; k < n; k++ {
			if tot(d.Order[k]) < tot(d.Order[k-1]) {
				fail("failover not by estimate at %d", k)
			}
		}
		best := tot(d.Order[0])
		for i := range n {
			best = min(best, tot(i))
		}
		within := func(i int) bool {
			t := tot(i)
			return t-best <= p.AbsMargin || float64(t) <= p.RelMargin*float64(best)
		}
		local := slices.IndexFunc(cands, func(c routing.Cand) bool { return c.Local })
		if d.Affine >= 0 && (cands[d.Affine].Local || cands[d.Affine].Refused || cands[d.Affine].Cooled) {
			fail("affine %d not eligible", d.Affine)
		}
		if (req.Key == 0) != (d.Affine < 0) && slices.ContainsFunc(cands, func(c routing.Cand) bool { return !c.Local && !c.Refused && !c.Cooled }) {
			fail("affine %d for key %#x", d.Affine, req.Key)
		}
		first := d.Order[0]
		switch d.Reason {
		case routing.ReasonLocal:
			if first != local || !within(local) {
				fail("local reason")
			}
			if a := d.Affine; a >= 0 && within(a) && !(d.Estimates[local].Cached > 0 && d.Estimates[local].Cached >= d.Estimates[a].Cached) {
				fail("local first over an affine peer within the margin that holds more of the prompt")
			}
		case routing.ReasonAffinity:
			if first != d.Affine || !within(first) ||
				local >= 0 && within(local) && d.Estimates[local].Cached > 0 && d.Estimates[local].Cached >= d.Estimates[first].Cached {
				fail("affinity reason")
			}
		case routing.ReasonSpill, routing.ReasonLeastTTFT:
			if tot(first) != best || (local >= 0) != (d.Reason == routing.ReasonSpill) ||
				local >= 0 && within(local) || d.Affine >= 0 && within(d.Affine) {
				fail("best reason")
			}
		default:
			fail("reason %q", d.Reason)
		}
		if !slices.Contains(routing.Reasons(), d.Reason) {
			fail("reason %q not listed", d.Reason)
		}
	}
}
