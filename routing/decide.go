package routing

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// Policy is how a role's candidates are ordered.
type Policy uint8

// Policies. The zero Policy is PolicyAuto.
const (
	PolicyAuto Policy = iota
	PolicyLocalFirst
	PolicyLeastLoaded
)

// Policies' config names.
var policyNames = [...]string{"auto", "local-first", "least-loaded"}

func (p Policy) String() string {
	if int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("Policy(%d)", uint8(p))
}

// ParsePolicy reads a policy's config name.
func ParsePolicy(s string) (Policy, error) {
	for i, n := range policyNames {
		if s == n {
			return Policy(i), nil
		}
	}
	return 0, fmt.Errorf("unknown routing policy %q (want auto, local-first or least-loaded)", s)
}

// Reason says why the first candidate was chosen.
type Reason string

// Reasons.
const (
	ReasonLocal       Reason = "local"        // the local instance, within the margin of the best
	ReasonAffinity    Reason = "affinity"     // the key's rendezvous peer, within the margin
	ReasonLeastTTFT   Reason = "least-ttft"   // the lowest estimate
	ReasonSpill       Reason = "spill"        // the lowest estimate, past a local instance outside the margin
	ReasonQueued      Reason = "queued"       // held while every candidate was full, then the lowest estimate
	ReasonFailover    Reason = "failover"     // an earlier candidate failed before its first byte
	ReasonLeastLoaded Reason = "least-loaded" // PolicyLeastLoaded's pick
	ReasonOrder       Reason = "order"        // PolicyLocalFirst's pick of a peer: no local instance
	ReasonOnly        Reason = "only"         // a single candidate: nothing to decide
)

// Reasons lists every Reason, for metrics that must exist before use.
func Reasons() []Reason {
	return []Reason{ReasonLocal, ReasonAffinity, ReasonLeastTTFT, ReasonSpill, ReasonQueued, ReasonFailover, ReasonLeastLoaded, ReasonOrder, ReasonOnly}
}

// Params tune the estimate and the choice. Zero values mean the defaults.
type Params struct {
	// AbsMargin and RelMargin bound how much worse than the best a
	// candidate may be and still be kept for locality or affinity.
	// Defaults 50ms and 1.5.
	AbsMargin time.Duration
	RelMargin float64
	// Service is the service time of an instance with none measured yet.
	// Default 1s.
	Service time.Duration
	// PrefillPerToken is the prefill cost per token of an instance with
	// none measured yet. Default 100µs.
	PrefillPerToken time.Duration
	// Penalty is added to the estimate of a peer that refused the role
	// or is cooled down. Default 1h (last, in effect).
	Penalty time.Duration
}

// DefaultParams returns the defaults.
func DefaultParams() Params {
	return Params{AbsMargin: 50 * time.Millisecond, RelMargin: 1.5, Service: time.Second,
		PrefillPerToken: 100 * time.Microsecond, Penalty: time.Hour}
}

func (p Params) withDefaults() Params {
	d := DefaultParams()
	if p.AbsMargin <= 0 {
		p.AbsMargin = d.AbsMargin
	}
	if p.RelMargin < 1 {
		p.RelMargin = d.RelMargin
	}
	if p.Service <= 0 {
		p.Service = d.Service
	}
	if p.PrefillPerToken <= 0 {
		p.PrefillPerToken = d.PrefillPerToken
	}
	if p.Penalty <= 0 {
		p.Penalty = d.Penalty
	}
	return p
}

// Cand is what is known of one candidate.
type Cand struct {
	Local bool
	Node  string
	// Slots is how many requests the instance runs at once; 0: unknown.
	Slots uint32
	// Running and Waiting are the instance's own counts (its metrics).
	Running, Waiting uint32
	// InFlight is the agent's count of requests at the instance: the
	// local agent's exactly, a peer's as last reported plus what this
	// node has sent it since.
	InFlight uint32
	// RTT is the round trip to a peer; 0 for the local instance.
	RTT time.Duration
	// Service and PrefillPerToken are the instance's recent service time
	// and prefill cost per token; 0: not measured (Params' defaults).
	Service, PrefillPerToken time.Duration
	// CachedTokens is how much of the prompt the instance probably holds
	// (Index).
	CachedTokens int
	// Refused and Cooled: the peer's agent refused the role recently, or
	// it is cooled down after failures. Fails counts recent failures.
	Refused, Cooled bool
	Fails           int
}

// occupancy is the requests at the instance, in 64 bits so that a
// garbled report cannot wrap round to idle.
func (c *Cand) occupancy() uint64 {
	return max(uint64(c.InFlight), uint64(c.Running)+uint64(c.Waiting))
}

// Full reports whether the candidate's slots are known and all taken.
func (c *Cand) Full() bool { return c.Slots > 0 && c.occupancy() >= uint64(c.Slots) }

// maxQueue bounds the queue estimate (about two years: never, in effect)
// so that the total, scaled by failures, cannot overflow to a negative
// estimate that would win.
const maxQueue = float64(1 << 56)

// Estimate is a candidate's estimated time to the first token, in parts.
type Estimate struct {
	Queue, Prefill, Network, Penalty time.Duration
	// Total is the sum, scaled by recent failures.
	Total time.Duration
	// Cached is the prompt's tokens the candidate probably holds.
	Cached int
	Full   bool
}

// Estimate computes c's estimate for a prompt of tokens.
func (p Params) estimate(c *Cand, tokens int) Estimate {
	svc := c.Service
	if svc <= 0 {
		svc = p.Service
	}
	per := c.PrefillPerToken
	if per <= 0 {
		per = p.PrefillPerToken
	}
	e := Estimate{Network: c.RTT, Cached: min(max(c.CachedTokens, 0), tokens), Full: c.Full()}
	if o, s := c.occupancy(), uint64(max(c.Slots, 1)); o >= s {
		e.Queue = time.Duration(min(float64(svc)*float64(o-s+1)/float64(s), maxQueue))
	}
	e.Prefill = time.Duration(tokens-e.Cached) * per
	if c.Refused || c.Cooled {
		e.Penalty = p.Penalty
	}
	e.Total = e.Queue + e.Prefill + e.Network + e.Penalty
	if c.Fails > 0 {
		e.Total += e.Total * time.Duration(min(c.Fails, 8)) / 2
	}
	return e
}

// Estimate computes c's estimate for a prompt of tokens.
func (p Params) Estimate(c Cand, tokens int) Estimate { return p.withDefaults().estimate(&c, tokens) }

// Request is what Decide needs of a request.
type Request struct {
	Tokens int    // prompt tokens (estimated)
	Key    uint64 // affinity key; 0: none
	// Place is the node the key is placed on (Placer), the local
	// instance's Node among them; "": plain rendezvous over the peers.
	Place string
}

// Decision is Decide's answer.
type Decision struct {
	// Order is the candidates' indices in the order to try them.
	Order  []int
	Reason Reason
	// Estimates are the candidates' estimates, by their index (nil for
	// PolicyLocalFirst, which estimates nothing).
	Estimates []Estimate
	// Affine is the index of the key's rendezvous peer; -1: none.
	Affine int
	// Full: every candidate's slots are known and taken.
	Full bool
}

// Decide orders cands for req under policy. order and ests are reused
// for the answer's slices.
func Decide(policy Policy, cands []Cand, req Request, p Params, order []int, ests []Estimate) Decision {
	d := Decision{Order: order[:0], Affine: -1}
	n := len(cands)
	for i := range n {
		d.Order = append(d.Order, i)
	}
	if n == 0 {
		return d
	}
	if n == 1 {
		d.Reason = ReasonOnly
		d.Full = cands[0].Full()
		return d
	}
	if policy == PolicyLocalFirst {
		d.Reason = ReasonOrder
		if cands[0].Local {
			d.Reason = ReasonLocal
		}
		d.Full = true
		for i := range cands {
			d.Full = d.Full && cands[i].Full()
		}
		return d
	}
	p = p.withDefaults()
	d.Estimates = ests[:0]
	d.Full = true
	for i := range cands {
		e := p.estimate(&cands[i], req.Tokens)
		d.Estimates = append(d.Estimates, e)
		d.Full = d.Full && e.Full
	}
	if policy == PolicyLeastLoaded {
		slices.SortStableFunc(d.Order, func(a, b int) int {
			if pa, pb := d.Estimates[a].Penalty > 0, d.Estimates[b].Penalty > 0; pa != pb {
				if pa {
					return 1
				}
				return -1
			}
			return cmp.Compare(loadShare(&cands[a]), loadShare(&cands[b]))
		})
		d.Reason = ReasonLeastLoaded
		return d
	}
	// By estimate; ties: the local instance, then by node, then as given
	// (a total order: no stable sort needed).
	slices.SortFunc(d.Order, func(a, b int) int {
		if c := cmp.Compare(d.Estimates[a].Total, d.Estimates[b].Total); c != 0 {
			return c
		}
		if cands[a].Local != cands[b].Local {
			if cands[a].Local {
				return -1
			}
			return 1
		}
		if c := cmp.Compare(cands[a].Node, cands[b].Node); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	best := d.Estimates[d.Order[0]].Total
	withinTotal := func(t time.Duration) bool {
		return t-best <= p.AbsMargin || float64(t) <= p.RelMargin*float64(best)
	}
	within := func(i int) bool { return withinTotal(d.Estimates[i].Total) }
	local := -1
	for i := range cands {
		if cands[i].Local {
			local = i
			break
		}
	}
	placed := false
	if req.Key != 0 {
		d.Affine, placed = affine(cands, req)
	}
	// The local instance goes first within the margin when the key's
	// peer has no claim over it: no key, or the local instance holds as
	// much of the prompt as that peer does (some at least). Otherwise a
	// tenant new to both would warm the local cache, and a busy local
	// instance would end up holding every tenant and keeping none.
	//
	// A placed key (Request.Place) goes to its node, the local instance
	// or a peer, within the margin: the placement already gave the local
	// instance its share of the keys.
	//
	// A placed node is judged as if it held the prompt as well as the
	// warmest candidate does: a node the placement has just given the key
	// (a join, a rebalance) lacks its cache only until its first request,
	// and left to the margin it would never get that one while another
	// node holds the prefix: the key would stay with whichever node had
	// it first, and the placement's balance would hold on paper only.
	// Its queue, its network and its failures still count.
	affineOK := d.Affine >= 0 && (within(d.Affine) || (placed && withinTotal(warmTotal(p, cands, d.Affine, req.Tokens, d.Estimates))))
	// (Only a placement makes the local instance the key's node: plain
	// rendezvous is over the peers.)
	localFirst := local >= 0 && ((d.Affine == local && affineOK) || (within(local) && (d.Affine < 0 ||
		(!placed && d.Estimates[local].Cached > 0 && d.Estimates[local].Cached >= d.Estimates[d.Affine].Cached))))
	switch {
	case localFirst:
		d.Reason = ReasonLocal
		moveFirst(d.Order, local)
	case affineOK:
		d.Reason = ReasonAffinity
		moveFirst(d.Order, d.Affine)
	case local >= 0 && within(local):
		d.Reason = ReasonLocal
		moveFirst(d.Order, local)
	case local >= 0:
		d.Reason = ReasonSpill
	default:
		d.Reason = ReasonLeastTTFT
	}
	return d
}

// warmTotal is cands[i]'s estimated total as if it held as much of the
// prompt as the warmest candidate (ests) does.
func warmTotal(p Params, cands []Cand, i, tokens int, ests []Estimate) time.Duration {
	warm := 0
	for _, e := range ests {
		warm = max(warm, e.Cached)
	}
	if warm <= ests[i].Cached {
		return ests[i].Total
	}
	c := cands[i]
	c.CachedTokens = warm
	return p.estimate(&c, tokens).Total
}

// loadShare is PolicyLeastLoaded's key after the penalties: occupancy
// against slots (against one slot when unknown).
func loadShare(c *Cand) float64 {
	return float64(c.occupancy()) / float64(max(c.Slots, 1))
}

// moveFirst moves the entry i to the front of order, the rest in order.
func moveFirst(order []int, i int) {
	at := slices.Index(order, i)
	copy(order[1:at+1], order[:at])
	order[0] = i
}

// affine is the index of req's placed candidate (placed true), or else of
// its key's rendezvous peer among the peers that did not refuse the role
// and are not cooled down; -1: none.
func affine(cands []Cand, req Request) (int, bool) {
	if req.Place != "" {
		for i := range cands {
			if c := &cands[i]; c.Node == req.Place && eligible(c) {
				return i, true
			}
		}
	}
	return rendezvousPeer(cands, req.Key), false
}

func rendezvousPeer(cands []Cand, key uint64) int {
	best, bestScore := -1, uint64(0)
	for i := range cands {
		c := &cands[i]
		if c.Local || c.Refused || c.Cooled {
			continue
		}
		if s := Rendezvous(key, c.Node); best < 0 || s > bestScore || (s == bestScore && c.Node < cands[best].Node) {
			best, bestScore = i, s
		}
	}
	return best
}
