package routing

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"time"
)

// Placer places a role's affinity keys on its candidates by rendezvous
// hashing bounded by load (consistent hashing with bounded loads): each
// key takes the first node in its rendezvous order whose share of the
// keys' recent requests stays within 1.1 times its fair share (by
// slots), the least loaded when none has room. Plain rendezvous puts, by
// chance, 9 of 16 tenants on one of three peers, which then cannot keep
// up, or cannot cache them all, at a load the others idle through.
//
// No node talks to another about it: each places from the keys it sees,
// weighted by their recent requests (decayed with PlaceHalfLife), and the
// weights are rounded to powers of four of the mean before they count, so
// consumers that see the same tenants at about the same rates (the noise
// of a few requests does not move a power of four) place them alike. The
// local instance is a node of its own here, under this node's name, as
// other consumers see it: a consumer that serves the role takes its share
// of the tenants and no more.
//
// The placement is made again every PlaceEvery, or at once when the
// candidates change (a node joins, leaves, refuses or is cooled down, or
// its slots change); a key seen since is placed on arrival against the
// placement's loads. Keys are tracked up to MaxPlacedKeys; past that, a
// new key falls back to plain rendezvous until old ones decay away.
//
// Safe for concurrent use. Like the rest of the package it has no clock:
// callers pass now.
type Placer struct {
	mu        sync.Mutex
	keys      map[uint64]keyWeight
	cur       placed
	computing bool
}

// Placement constants.
const (
	PlaceHalfLife = 30 * time.Second
	PlaceEvery    = time.Second
	MaxPlacedKeys = 2048
	// placeForget: a key whose weight decayed below it is dropped (about
	// six half-lives unseen).
	placeForget = 1.0 / 64
	// placeTries bounds how far down its rendezvous order a key looks
	// for room before it takes the least loaded node.
	placeTries = 8
	// placeSlack is how far over its fair share a node's load may go
	// (Mirrokni, Thorup and Zadimoghaddam's 1+ε; Vimeo runs ε = 0.25):
	// below it a key stays on its first node, so only a real pile-up
	// moves keys. ε = 0.1 because tenants are few: 16 over four nodes
	// at 1.25 lets one take 5, a quarter over its capacity when the
	// mesh runs at capacity, where 1.1 gives each 4 (what a router that
	// sees every request does); agreement between consumers comes from
	// the rounded weights, not from the slack.
	placeSlack = 1.1
	// placePrior is the requests every key is counted as having had
	// beyond its own when weights are rounded: a key seen a few times is
	// not yet heavier or lighter than the rest (Poisson noise at a mean
	// of 3 reaches twice the mean one time in ten; with 8 more on both
	// sides, about never), while a tenant seen hundreds of times is
	// weighed by its own count.
	placePrior = 8.0
)

type keyWeight struct {
	w  float64
	at time.Time
}

// placed is one placement: the nodes it was made over (by their
// signature) and each key's node index.
type placed struct {
	sig   uint64
	at    time.Time
	nodes []placeNode
	total float64 // the placed keys' rounded weights
	mean  float64 // the keys' mean weight (unrounded), for rounding a new one
	of    map[uint64]int32
	// scores is choose's scratch.
	scores []float64
}

type placeNode struct {
	name  string
	slots float64
	load  float64
}

// NewPlacer returns an empty placer.
func NewPlacer() *Placer { return &Placer{keys: map[uint64]keyWeight{}} }

// Observe counts a request of key at now.
func (p *Placer) Observe(key uint64, now time.Time) {
	if key == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	kw, ok := p.keys[key]
	if !ok && len(p.keys) >= MaxPlacedKeys {
		return
	}
	p.keys[key] = keyWeight{w: decayed(kw, now) + 1, at: now}
}

func decayed(kw keyWeight, now time.Time) float64 {
	if kw.w == 0 {
		return 0
	}
	dt := now.Sub(kw.at)
	if dt <= 0 {
		return kw.w
	}
	return kw.w * math.Exp2(-float64(dt)/float64(PlaceHalfLife))
}

// eligible reports whether c may be a key's node: the local instance, or
// a peer that has not refused the role and is not cooled down.
func eligible(c *Cand) bool { return c.Local || !(c.Refused || c.Cooled) }

// signature names the set of eligible candidates and their slots,
// whatever their order.
func signature(cands []Cand) uint64 {
	var sig uint64
	for i := range cands {
		c := &cands[i]
		if eligible(c) {
			sig += Rendezvous(uint64(c.Slots)+1, c.Node)
		}
	}
	return sig
}

// Place is the node key is placed on among cands (a Cand's Node; the
// local instance's Node is this node's name), or "" when it has none: no
// key, no eligible candidate, or a key not tracked.
func (p *Placer) Place(cands []Cand, key uint64, now time.Time) string {
	if key == 0 {
		return ""
	}
	sig := signature(cands)
	p.mu.Lock()
	if p.computing || (p.cur.sig == sig && now.Sub(p.cur.at) < PlaceEvery && p.cur.of != nil) {
		defer p.mu.Unlock()
		return p.lookupLocked(key, now)
	}
	p.computing = true
	keys := p.snapshotLocked(now)
	nodes := nodesOf(cands)
	p.mu.Unlock()

	next := place(keys, nodes)
	next.sig, next.at = sig, now

	p.mu.Lock()
	defer p.mu.Unlock()
	p.cur, p.computing = next, false
	return p.lookupLocked(key, now)
}

// lookupLocked is key's node in the current placement, placing a key seen
// since it was made against its loads.
func (p *Placer) lookupLocked(key uint64, now time.Time) string {
	c := &p.cur
	if len(c.nodes) == 0 {
		return ""
	}
	if i, ok := c.of[key]; ok {
		return c.nodes[i].name
	}
	kw, ok := p.keys[key]
	if !ok {
		return ""
	}
	w := rounded(decayed(kw, now), c.mean)
	i := c.choose(key, w, c.total+w)
	c.nodes[i].load += w
	c.total += w
	c.of[key] = int32(i)
	return c.nodes[i].name
}

type placeKey struct {
	key uint64
	w   float64
}

// snapshotLocked is the keys' weights at now, dropping the forgotten.
func (p *Placer) snapshotLocked(now time.Time) []placeKey {
	out := make([]placeKey, 0, len(p.keys))
	for k, kw := range p.keys {
		w := decayed(kw, now)
		if w < placeForget {
			delete(p.keys, k)
			continue
		}
		out = append(out, placeKey{k, w})
	}
	return out
}

// nodesOf is cands' eligible nodes, sorted by name, with their slots (an
// unknown count counts as the mean of the known, or 1).
func nodesOf(cands []Cand) []placeNode {
	var out []placeNode
	known, sum := 0, 0.0
	for i := range cands {
		if c := &cands[i]; eligible(c) {
			out = append(out, placeNode{name: c.Node, slots: float64(c.Slots)})
			if c.Slots > 0 {
				known++
				sum += float64(c.Slots)
			}
		}
	}
	unknown := 1.0
	if known > 0 {
		unknown = sum / float64(known)
	}
	for i := range out {
		if out[i].slots == 0 {
			out[i].slots = unknown
		}
	}
	slices.SortFunc(out, func(a, b placeNode) int { return cmp.Compare(a.name, b.name) })
	return out
}

// rounded is w as a power of four of mean, from 1/16 to 64 times it: a
// tenant counts as heavier or lighter than the rest only at twice or half
// the mean, which the noise of a few requests does not reach (both with
// placePrior added, so that a few requests alone never do).
func rounded(w, mean float64) float64 {
	if mean <= 0 || w <= 0 {
		return 1
	}
	e := min(max(math.Round(math.Log2((w+placePrior)/(mean+placePrior))/2), -2), 3)
	return math.Exp2(2 * e)
}

// place makes the placement of keys over nodes: the heaviest keys first
// (ties by key), each on the first node in its rendezvous order with room
// for it under its fair share of the total (or of the heaviest key, when
// that is more), or the least loaded node.
func place(keys []placeKey, nodes []placeNode) placed {
	out := placed{nodes: nodes, of: make(map[uint64]int32, len(keys))}
	if len(nodes) == 0 || len(keys) == 0 {
		return out
	}
	sum := 0.0
	for _, k := range keys {
		sum += k.w
	}
	out.mean = sum / float64(len(keys))
	for i := range keys {
		keys[i].w = rounded(keys[i].w, out.mean)
		out.total += keys[i].w
	}
	slices.SortFunc(keys, func(a, b placeKey) int {
		if c := cmp.Compare(b.w, a.w); c != 0 {
			return c
		}
		return cmp.Compare(a.key, b.key)
	})
	for _, k := range keys {
		i := out.choose(k.key, k.w, out.total)
		out.nodes[i].load += k.w
		out.of[k.key] = int32(i)
	}
	return out
}

// choose is the node for a key of weight w, where the keys' total weight
// is total: the first in the key's rendezvous order (up to placeTries)
// whose load stays within its bound, else the least loaded by slots.
func (c *placed) choose(key uint64, w, total float64) int {
	slots := 0.0
	c.scores = c.scores[:0]
	for _, n := range c.nodes {
		slots += n.slots
		c.scores = append(c.scores, weightedScore(key, n))
	}
	for range min(placeTries, len(c.nodes)) {
		// The next in rendezvous order: the highest score left (ties
		// by name, as nodes are sorted by name).
		best := -1
		for i, s := range c.scores {
			if s >= 0 && (best < 0 || s > c.scores[best]) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		n := &c.nodes[best]
		if n.load+w <= max(total*n.slots/slots*placeSlack, w)+1e-9 {
			return best
		}
		c.scores[best] = -1
	}
	least := 0
	for i := range c.nodes {
		if c.nodes[i].load/c.nodes[i].slots < c.nodes[least].load/c.nodes[least].slots {
			least = i
		}
	}
	return least
}

// weightedScore is node's weighted rendezvous score for key: slots over
// -ln u, u the node's hash for the key in (0, 1), so that a node wins
// keys in proportion to its slots and a node joining or leaving still
// moves only its own (Schindelhauer and Schomaker's weighted HRW).
func weightedScore(key uint64, n placeNode) float64 {
	u := (float64(Rendezvous(key, n.name)>>11) + 0.5) / (1 << 53)
	return n.slots / -math.Log(u)
}
