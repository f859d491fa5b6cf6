package routing_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/infermesh/infermesh/routing"
)

const rendezvousKeys = 10000

func randomKeys(seed uint64) []uint64 {
	r := rand.New(rand.NewPCG(seed, seed^0x5bd1e995))
	keys := make([]uint64, rendezvousKeys)
	for i := range keys {
		keys[i] = r.Uint64() | 1 // 0 is no key
	}
	return keys
}

// affineOf is the key's affine peer as Decide picks it among idle peers.
func affineOf(key uint64, nodes ...string) string {
	cands := make([]routing.Cand, len(nodes))
	for i, n := range nodes {
		cands[i] = routing.Cand{Node: n, Slots: 4}
	}
	d := routing.Decide(routing.PolicyAuto, cands, routing.Request{Key: key}, routing.Params{}, nil, nil)
	if d.Affine < 0 {
		return ""
	}
	return cands[d.Affine].Node
}

func TestRendezvousSpread(t *testing.T) {
	for _, tt := range []struct {
		seed  uint64
		nodes []string
	}{
		{1, []string{"b", "c", "d"}},
		{2, []string{"node-1", "node-2", "node-3"}},
		{3, []string{"10.0.0.11", "10.0.0.12", "10.0.0.13", "10.0.0.14"}},
		{4, []string{"gpu-a", "gpu-b"}},
	} {
		count := map[string]int{}
		for _, k := range randomKeys(tt.seed) {
			count[affineOf(k, tt.nodes...)]++
		}
		want := 1 / float64(len(tt.nodes))
		for _, n := range tt.nodes {
			if share := float64(count[n]) / rendezvousKeys; math.Abs(share-want) > 0.03 {
				t.Errorf("%v: %s has %.3f of the keys, want %.3f±0.03 (%v)", tt.nodes, n, share, want, count)
			}
		}
	}
}

// A peer that joins takes about its share of the keys, and only keys
// move to it; one that leaves gives up only its own.
func TestRendezvousMinimalMovement(t *testing.T) {
	keys := randomKeys(5)
	moved := 0
	for _, k := range keys {
		before, after := affineOf(k, "b", "c", "d"), affineOf(k, "b", "c", "d", "e")
		if before != after {
			if after != "e" {
				t.Fatalf("key %#x moved %s -> %s when e joined", k, before, after)
			}
			moved++
		}
	}
	if share := float64(moved) / rendezvousKeys; math.Abs(share-0.25) > 0.03 {
		t.Errorf("e joining moved %.3f of the keys, want about 1/4", share)
	}
	lost := 0
	for _, k := range keys {
		before, after := affineOf(k, "b", "c", "d"), affineOf(k, "b", "c")
		if before != after {
			if before != "d" {
				t.Fatalf("key %#x moved %s -> %s when d left", k, before, after)
			}
			lost++
		} else if before == "d" {
			t.Fatalf("key %#x still on d after it left", k)
		}
	}
	if share := float64(lost) / rendezvousKeys; math.Abs(share-1.0/3) > 0.03 {
		t.Errorf("d leaving moved %.3f of the keys, want about 1/3", share)
	}
	// A peer that refuses or cools down is, for affinity, one that left.
	for _, k := range keys[:2000] {
		cands := []routing.Cand{{Node: "b", Slots: 4}, {Node: "c", Slots: 4}, {Node: "d", Slots: 4, Cooled: true}}
		d := routing.Decide(routing.PolicyAuto, cands, routing.Request{Key: k}, routing.Params{}, nil, nil)
		if got, want := cands[d.Affine].Node, affineOf(k, "b", "c"); got != want {
			t.Fatalf("key %#x: %s with d cooled, %s without d", k, got, want)
		}
	}
}

// Two consumer nodes that list the same candidates in different orders
// agree on the affine peer and on the whole order, without talking.
func TestRendezvousOrderIndependent(t *testing.T) {
	base := []routing.Cand{
		{Local: true, Node: "a", Slots: 4, InFlight: 8},
		{Node: "b", Slots: 4, RTT: 2 * ms},
		{Node: "c", Slots: 4, RTT: 2 * ms},
		{Node: "d", Slots: 4, RTT: 3 * ms, CachedTokens: 200},
		{Node: "e", Slots: 2, RTT: 4 * ms, Refused: true},
		{Node: "f", Slots: 4, RTT: 2 * ms},
		{Node: "g", RTT: 2 * ms},
	}
	r := rand.New(rand.NewPCG(6, 7))
	for _, k := range randomKeys(8)[:1000] {
		req := routing.Request{Tokens: 800, Key: k}
		d := routing.Decide(routing.PolicyAuto, base, req, routing.Params{}, nil, nil)
		wantAffine, wantOrder := base[d.Affine].Node, names(base, d.Order)
		for range 5 {
			cands := append([]routing.Cand(nil), base...)
			r.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
			d := routing.Decide(routing.PolicyAuto, cands, req, routing.Params{}, nil, nil)
			if got := cands[d.Affine].Node; got != wantAffine {
				t.Fatalf("key %#x: affine %s shuffled, %s not", k, got, wantAffine)
			}
			if got := names(cands, d.Order); got != wantOrder {
				t.Fatalf("key %#x: order %s shuffled, %s not", k, got, wantOrder)
			}
		}
	}
}

// The score is a function of the key and the name alone.
func TestRendezvousDeterministic(t *testing.T) {
	if routing.Rendezvous(42, "b") != routing.Rendezvous(42, "b") {
		t.Fatal("score not deterministic")
	}
	if routing.Rendezvous(42, "b") == routing.Rendezvous(42, "c") || routing.Rendezvous(42, "b") == routing.Rendezvous(43, "b") {
		t.Fatal("score ignores the name or the key")
	}
}
