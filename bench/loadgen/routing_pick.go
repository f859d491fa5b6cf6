package main

import (
	"cmp"
	"slices"
	"sync/atomic"
)

// The load generator's own routers, the anchors of the routing benchmark:
// what a plain load balancer achieves (round robin, least outstanding) and
// what a router that knows every request achieves (the oracle). Each
// counts the requests it has outstanding at each target; it is the only
// client of the engines in a direct row, so that count is exact.

// Policies of a row.
const (
	policyRoundRobin = "round-robin"
	policyLeast      = "least-outstanding"
	policyOracle     = "oracle"
	// policyMesh spreads requests round robin over one or more agents'
	// loopback ports; where they go from there is the agents' decision.
	policyMesh = "mesh"
)

// picker chooses a target for each request. pick is called from one
// goroutine at a time (the dispatcher); done from any.
type picker struct {
	policy      string
	slots       int   // each target's slots (the oracle's fallback)
	affine      []int // the oracle's engine for each tenant
	outstanding []atomic.Int64
	next        int // round robin, and the rotation that breaks ties
}

// newPicker makes a picker over the targets called names; weights are the
// tenants' shares of the requests (the oracle's affinity needs them).
func newPicker(policy string, names []string, slots int, weights []float64) *picker {
	p := &picker{policy: policy, slots: slots, outstanding: make([]atomic.Int64, len(names))}
	if policy == policyOracle {
		p.affine = affinity(names, weights)
	}
	return p
}

// pick returns the target for a request of tenant and counts it
// outstanding there.
func (p *picker) pick(tenant int) int {
	i := 0
	switch p.policy {
	case policyLeast:
		i = p.least()
	case policyOracle:
		// Affinity per tenant; the least loaded target when the affine
		// one has more than twice its slots outstanding.
		i = p.affine[tenant]
		if p.outstanding[i].Load() > int64(2*p.slots) {
			i = p.least()
		}
	default: // round robin, and the mesh's agents
		i = p.next % len(p.outstanding)
		p.next++
	}
	p.outstanding[i].Add(1)
	return i
}

// least is the target with the fewest requests outstanding, ties broken
// by a rotation so that none is favoured.
func (p *picker) least() int {
	n := len(p.outstanding)
	best, bestN := -1, int64(0)
	for k := range n {
		i := (p.next + k) % n
		if o := p.outstanding[i].Load(); best < 0 || o < bestN {
			best, bestN = i, o
		}
	}
	p.next++
	return best
}

func (p *picker) done(i int) { p.outstanding[i].Add(-1) }

// affinity is the oracle's placement of the tenants: rendezvous hashing
// with a bound on load. The oracle knows every tenant and its share of
// the requests (weights), so it takes the tenants from the most requested
// and gives each the first engine in its rendezvous order whose share
// stays within the fair one (1/engines, or the largest tenant's share when
// that is more), the least loaded when none has room. Plain rendezvous
// puts, by chance, 9 of 16 tenants on one of three engines, which then
// cannot keep up at a load the others idle through. Every chooser with the
// same names and weights gets the same placement.
func affinity(names []string, weights []float64) []int {
	out := make([]int, len(weights))
	order := make([]int, len(weights))
	for t := range weights {
		order[t] = t
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(weights[b], weights[a]) })
	bound := 1 / float64(len(names))
	if len(weights) > 0 {
		bound = max(bound, slices.Max(weights))
	}
	bound += 1e-9
	load := make([]float64, len(names))
	for _, t := range order {
		ranked := rendezvousOrder(tenantKey(t), names)
		out[t] = -1
		for _, e := range ranked {
			if load[e]+weights[t] <= bound {
				out[t] = e
				break
			}
		}
		if out[t] < 0 {
			out[t] = ranked[0]
			for _, e := range ranked {
				if load[e] < load[out[t]] {
					out[t] = e
				}
			}
		}
		load[out[t]] += weights[t]
	}
	return out
}

// rendezvousOrder ranks names for key, the highest weight first.
func rendezvousOrder(key string, names []string) []int {
	idx := make([]int, len(names))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		return cmp.Compare(rendezvousWeight(key, names[b]), rendezvousWeight(key, names[a]))
	})
	return idx
}

// rendezvous returns the index of the name with the highest weight for
// key (highest random weight hashing): every chooser with the same names
// picks the same one, and removing a name moves only the keys it had.
func rendezvous(key string, names []string) int {
	best, bestW := 0, uint64(0)
	for i, n := range names {
		if w := rendezvousWeight(key, n); i == 0 || w > bestW {
			best, bestW = i, w
		}
	}
	return best
}

func rendezvousWeight(key, name string) uint64 {
	h := uint64(14695981039346656037)
	for _, s := range [...]string{key, "\x00", name} {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint64(s[i])) * 1099511628211
		}
	}
	// splitmix64's finalizer spreads FNV's weak low bits.
	h ^= h >> 30
	h *= 0xBF58476D1CE4E5B9
	h ^= h >> 27
	h *= 0x94D049BB133111EB
	return h ^ h>>31
}
