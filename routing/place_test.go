package routing_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func peers(slots uint32, names ...string) []routing.Cand {
	out := make([]routing.Cand, len(names))
	for i, n := range names {
		out[i] = routing.Cand{Node: n, Slots: slots}
	}
	return out
}

// observeAll counts n requests of each key over the placer's half-life,
// with rate noise from r (nil: none), ending at now.
func observeAll(p *routing.Placer, keys []uint64, n int, r *rand.Rand, now time.Time) {
	for _, k := range keys {
		m := n
		if r != nil {
			m = n + r.IntN(n/3+1) - n/6 // ±1/6
		}
		for i := range m {
			p.Observe(k, now.Add(-time.Duration(i)*routing.PlaceHalfLife/time.Duration(4*n)))
		}
	}
}

// placeAll is every key's node.
func placeAll(p *routing.Placer, cands []routing.Cand, keys []uint64, now time.Time) map[uint64]string {
	out := map[uint64]string{}
	for _, k := range keys {
		out[k] = p.Place(cands, k, now)
	}
	return out
}

func loads(of map[uint64]string) map[string]int {
	n := map[string]int{}
	for _, node := range of {
		n[node]++
	}
	return n
}

// Equal tenants: no node gets more than its fair share, rounded up, plus
// one (16 over three: at most 6; over four: exactly 4 each), where plain
// rendezvous piles up to 9 of 16 on one of three (the seeds below hold
// ones where it does).
func TestPlacerBoundsTheLoad(t *testing.T) {
	worstPlain := 0
	for seed := range uint64(50) {
		keys := randomKeys(seed)[:16]
		p := routing.NewPlacer()
		observeAll(p, keys, 20, nil, t0)
		for _, tt := range []struct {
			nodes []string
			most  int
		}{{[]string{"b", "c", "d"}, 6}, {[]string{"b", "c", "d", "f"}, 4}} {
			of := placeAll(p, peers(4, tt.nodes...), keys, t0)
			for node, n := range loads(of) {
				if n > tt.most {
					t.Errorf("seed %d: %s has %d of 16 tenants over %d nodes, want at most %d: %v", seed, node, n, len(tt.nodes), tt.most, loads(of))
				}
			}
		}
		plain := map[string]int{}
		for _, k := range keys {
			plain[affineOf(k, "b", "c", "d")]++
		}
		for _, n := range plain {
			worstPlain = max(worstPlain, n)
		}
	}
	if worstPlain < 8 {
		t.Errorf("plain rendezvous put at most %d of 16 on one node over 50 seeds: the test shows nothing", worstPlain)
	}
}

// Warming up: each tenant seen only a few times (Poisson, a mean of 3), so
// that by chance one has 8 and another 1. They still count as equals: no
// node gets more than 4 of 16 over four nodes, and two consumers with
// their own draws place every tenant alike.
func TestPlacerWarmingUp(t *testing.T) {
	poisson := func(r *rand.Rand, mean float64) int {
		n, p := 0, math.Exp(-mean)
		for f := r.Float64(); f > p; f *= r.Float64() {
			n++
		}
		return n
	}
	observe := func(p *routing.Placer, keys []uint64, r *rand.Rand) {
		for _, k := range keys {
			for i := range 1 + poisson(r, 2) { // every tenant seen at least once
				p.Observe(k, t0.Add(-time.Duration(i)*time.Second))
			}
		}
	}
	nodes := []string{"b", "c", "d", "f"}
	for seed := range uint64(50) {
		keys := randomKeys(200 + seed)[:16]
		a, b := routing.NewPlacer(), routing.NewPlacer()
		observe(a, keys, rand.New(rand.NewPCG(seed, 1)))
		observe(b, keys, rand.New(rand.NewPCG(seed, 2)))
		pa, pb := placeAll(a, peers(4, nodes...), keys, t0), placeAll(b, peers(4, nodes...), keys, t0)
		for node, n := range loads(pa) {
			if n > 4 {
				t.Errorf("seed %d: %s has %d of 16 tenants, want 4: %v", seed, node, n, loads(pa))
			}
		}
		for _, k := range keys {
			if pa[k] != pb[k] {
				t.Errorf("seed %d: key %#x on %s at one consumer, %s at the other", seed, k, pa[k], pb[k])
			}
		}
	}
}

// A node with twice the slots takes about twice the tenants.
func TestPlacerWeighsSlots(t *testing.T) {
	keys := randomKeys(7)[:400]
	p := routing.NewPlacer()
	observeAll(p, keys, 4, nil, t0)
	cands := []routing.Cand{{Node: "b", Slots: 8}, {Node: "c", Slots: 4}, {Node: "d", Slots: 4}}
	n := loads(placeAll(p, cands, keys, t0))
	t.Logf("tenants per node %v", n)
	if n["b"] < 180 || n["b"] > 220 || n["c"] > 110 || n["d"] > 110 {
		t.Errorf("tenants per node %v, want b about 200 (at most 220), c and d about 100 (at most 110)", n)
	}
}

// Two consumers that see the same tenants at about the same rates (each
// its own noise) place every one alike: the agreement that needs no
// coordination.
func TestPlacerAgreesAcrossConsumers(t *testing.T) {
	for seed := range uint64(20) {
		keys := randomKeys(100 + seed)[:16]
		a, b := routing.NewPlacer(), routing.NewPlacer()
		observeAll(a, keys, 30, rand.New(rand.NewPCG(seed, 1)), t0)
		observeAll(b, keys, 30, rand.New(rand.NewPCG(seed, 2)), t0)
		cands := peers(4, "b", "c", "d")
		slices.Reverse(cands) // each consumer lists its candidates in its own order
		pa, pb := placeAll(a, peers(4, "b", "c", "d"), keys, t0), placeAll(b, cands, keys, t0)
		for _, k := range keys {
			if pa[k] != pb[k] {
				t.Errorf("seed %d: key %#x on %s at one consumer, %s at the other", seed, k, pa[k], pb[k])
			}
		}
	}
}

// Popular tenants (zipf-like weights): the heaviest go first, and no node
// takes more than its fair share plus the heaviest tenant.
func TestPlacerSkewedTenants(t *testing.T) {
	keys := randomKeys(9)[:32]
	p := routing.NewPlacer()
	weight := map[uint64]float64{}
	total := 0.0
	for i, k := range keys {
		n := int(math.Ceil(64 / float64(i+1)))
		for j := range n {
			p.Observe(k, t0.Add(-time.Duration(j)*time.Millisecond))
		}
		weight[k] = float64(n)
		total += float64(n)
	}
	cands := peers(4, "b", "c", "d")
	of := placeAll(p, cands, keys, t0)
	per := map[string]float64{}
	for k, node := range of {
		per[node] += weight[k]
	}
	for node, w := range per {
		// Rounded weights are within 2× of the true ones, so allow that.
		if w > (total/3*1.1+64)*2 {
			t.Errorf("%s carries %.0f of %.0f requests: %v", node, w, total, per)
		}
	}
	if len(per) != 3 {
		t.Errorf("nodes used %v, want all three", per)
	}
}

// A node joining takes about its share; few keys move between the others.
// One leaving gives up its keys; few others move.
func TestPlacerMovesLittle(t *testing.T) {
	keys := randomKeys(11)[:600]
	p := routing.NewPlacer()
	observeAll(p, keys, 2, nil, t0)
	before := placeAll(p, peers(4, "b", "c", "d"), keys, t0)
	after := placeAll(p, peers(4, "b", "c", "d", "e"), keys, t0)
	toE, others := 0, 0
	for _, k := range keys {
		switch {
		case after[k] == "e":
			toE++
		case after[k] != before[k]:
			others++
		}
	}
	if toE < 130 || toE > 165 {
		t.Errorf("e joining took %d of 600 keys, want about 150 (at most 1.1 times)", toE)
	}
	if others > 30 {
		t.Errorf("e joining moved %d keys between the others, want few", others)
	}
	gone := placeAll(p, peers(4, "b", "c"), keys, t0)
	moved := 0
	for _, k := range keys {
		if before[k] != "d" && gone[k] != before[k] {
			moved++
		}
	}
	if moved > 60 {
		t.Errorf("d leaving moved %d keys that were not d's, want few", moved)
	}
	t.Logf("join: %d to e, %d between the others; leave: %d not d's moved", toE, others, moved)
}

// The local instance is a node of the placement under this node's name;
// refused and cooled peers are not.
func TestPlacerEligible(t *testing.T) {
	keys := randomKeys(13)[:300]
	p := routing.NewPlacer()
	observeAll(p, keys, 2, nil, t0)
	cands := []routing.Cand{{Local: true, Node: "a", Slots: 4}, {Node: "b", Slots: 4}, {Node: "c", Slots: 4, Refused: true}, {Node: "d", Slots: 4, Cooled: true, Local: false}}
	n := loads(placeAll(p, cands, keys, t0))
	if n["a"] < 135 || n["a"] > 165 || n["b"] < 135 || n["b"] > 165 || n["c"] != 0 || n["d"] != 0 {
		t.Errorf("tenants per node %v, want a and b about 150 each (at most 1.1 times), none on c or d", n)
	}
}

// A key first seen after the placement was made is placed on arrival,
// against its loads, and stays there; an unknown key (never observed) and
// the zero key have none.
func TestPlacerNewKeys(t *testing.T) {
	keys := randomKeys(17)[:31]
	p := routing.NewPlacer()
	observeAll(p, keys[:30], 4, nil, t0)
	cands := peers(4, "b", "c", "d")
	placeAll(p, cands, keys[:30], t0)
	p.Observe(keys[30], t0.Add(time.Millisecond))
	got := p.Place(cands, keys[30], t0.Add(2*time.Millisecond))
	if got == "" {
		t.Fatal("a new key got no node")
	}
	n := loads(placeAll(p, cands, keys, t0.Add(3*time.Millisecond)))
	if n["b"] > 11 || n["c"] > 11 || n["d"] > 11 {
		t.Errorf("tenants per node %v after the new key, want at most 11 (1.1 × 31/3)", n)
	}
	if again := p.Place(cands, keys[30], t0.Add(4*time.Millisecond)); again != got {
		t.Errorf("the new key moved from %s to %s", got, again)
	}
	if got := p.Place(cands, 12345, t0); got != "" {
		t.Errorf("an unobserved key placed on %s", got)
	}
	if got := p.Place(cands, 0, t0); got != "" {
		t.Errorf("the zero key placed on %s", got)
	}
}

// A key not seen for many half-lives is forgotten at the next placement;
// past MaxPlacedKeys, new keys are not tracked (plain rendezvous).
func TestPlacerForgetsAndBounds(t *testing.T) {
	p := routing.NewPlacer()
	cands := peers(4, "b", "c")
	p.Observe(1, t0)
	if p.Place(cands, 1, t0) == "" {
		t.Fatal("no node for a fresh key")
	}
	if got := p.Place(cands, 1, t0.Add(20*routing.PlaceHalfLife)); got != "" {
		t.Errorf("a key unseen for 20 half-lives is on %s, want forgotten", got)
	}
	p = routing.NewPlacer()
	for k := range uint64(routing.MaxPlacedKeys + 10) {
		p.Observe(k+100, t0)
	}
	tracked := 0
	for k := range uint64(routing.MaxPlacedKeys + 10) {
		if p.Place(cands, k+100, t0) != "" {
			tracked++
		}
	}
	if tracked != routing.MaxPlacedKeys {
		t.Errorf("%d keys tracked, want %d", tracked, routing.MaxPlacedKeys)
	}
}

// Decide follows a placement: the local instance first when the key is
// placed there, the placed peer within the margin over a better local
// instance, and a placed node that is not eligible falls back to plain
// rendezvous among the peers.
func TestDecideFollowsPlacement(t *testing.T) {
	local := routing.Cand{Local: true, Node: "a", Slots: 4}
	cands := []routing.Cand{local, {Node: "b", Slots: 4, RTT: time.Millisecond}, {Node: "c", Slots: 4, RTT: time.Millisecond}}
	// The local instance holds the prompt: plain rendezvous would keep
	// it local; a placement on c does not.
	cands[0].CachedTokens = 200
	for _, tt := range []struct {
		place, first string
		reason       routing.Reason
	}{
		{"a", "a", routing.ReasonLocal},
		{"c", "c", routing.ReasonAffinity},
		{"b", "b", routing.ReasonAffinity},
		{"", "a", routing.ReasonLocal},
		{"z", "a", routing.ReasonLocal}, // not a candidate: plain rules
	} {
		t.Run(fmt.Sprintf("place %q", tt.place), func(t *testing.T) {
			d := routing.Decide(routing.PolicyAuto, cands, routing.Request{Tokens: 1000, Key: 77, Place: tt.place}, routing.Params{}, nil, nil)
			if got := cands[d.Order[0]].Node; got != tt.first || d.Reason != tt.reason {
				t.Errorf("first %s (%s), want %s (%s)", got, d.Reason, tt.first, tt.reason)
			}
		})
	}
	// A placed peer that refused the role is not the key's node.
	ref := slices.Clone(cands)
	ref[2].Refused = true
	ref[0].CachedTokens = 0
	d := routing.Decide(routing.PolicyAuto, ref, routing.Request{Tokens: 1000, Key: 77, Place: "c"}, routing.Params{}, nil, nil)
	if d.Affine == 2 {
		t.Errorf("affine is the refused peer: %+v", d)
	}
	// A placed peer past the margin is left: the local instance within it.
	busy := slices.Clone(cands)
	busy[2].InFlight = 40
	d = routing.Decide(routing.PolicyAuto, busy, routing.Request{Tokens: 1000, Key: 77, Place: "c"}, routing.Params{}, nil, nil)
	if got := busy[d.Order[0]].Node; got != "a" || d.Reason != routing.ReasonLocal {
		t.Errorf("first %s (%s) past a saturated placed peer, want the local a", got, d.Reason)
	}
}

// A placed node without the prompt cached still gets the key while
// another holds it (once there, it caches it): judged as if it held the
// prompt as well, its queue still counting. Without a placement, the warm
// peer keeps it.
func TestDecidePlacedNodeWarmsUp(t *testing.T) {
	cands := []routing.Cand{
		{Local: true, Node: "a", Slots: 4},
		{Node: "b", Slots: 4, RTT: time.Millisecond, CachedTokens: 2000},
		{Node: "c", Slots: 4, RTT: time.Millisecond},
	}
	req := routing.Request{Tokens: 2100, Key: 77}
	for _, tt := range []struct {
		name   string
		place  string
		busy   int // the placed node's requests in flight
		first  string
		reason routing.Reason
	}{
		{"placed on the cold peer", "c", 0, "c", routing.ReasonAffinity},
		{"placed on the cold local instance", "a", 0, "a", routing.ReasonLocal},
		{"placed on the cold peer, queued", "c", 8, "b", routing.ReasonSpill},
		{"placed on the warm peer", "b", 0, "b", routing.ReasonAffinity},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cs := slices.Clone(cands)
			for i := range cs {
				if cs[i].Node == tt.place {
					cs[i].InFlight = uint32(tt.busy)
				}
			}
			r := req
			r.Place = tt.place
			d := routing.Decide(routing.PolicyAuto, cs, r, routing.Params{}, nil, nil)
			if got := cs[d.Order[0]].Node; got != tt.first || d.Reason != tt.reason {
				t.Errorf("first %s (%s), want %s (%s); estimates %+v", got, d.Reason, tt.first, tt.reason, d.Estimates)
			}
		})
	}
	// Plain rendezvous (no placement) leaves the key with the warm peer.
	d := routing.Decide(routing.PolicyAuto, cands, req, routing.Params{}, nil, nil)
	if got := cands[d.Order[0]].Node; got != "b" {
		t.Errorf("unplaced: first %s (%s), want the warm b", got, d.Reason)
	}
}

func BenchmarkPlacerPlace(b *testing.B) {
	for _, n := range []int{3, 64} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			names := make([]string, n)
			for i := range names {
				names[i] = fmt.Sprintf("node-%d", i)
			}
			cands := peers(4, names...)
			keys := randomKeys(3)[:256]
			p := routing.NewPlacer()
			observeAll(p, keys, 2, nil, t0)
			p.Place(cands, keys[0], t0)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				k := keys[i%len(keys)]
				now := t0.Add(time.Duration(i%1000) * time.Microsecond)
				p.Observe(k, now)
				p.Place(cands, k, now)
			}
		})
	}
}
