package proxy

import (
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infermesh/infermesh/clients"
	"github.com/infermesh/infermesh/internal/prompt"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/routing"
)

// Routing by capacity and cache (package routing decides; this file
// gathers what it decides from and keeps what it learns). It runs for an
// app's request with more than one candidate: a single candidate leaves
// nothing to decide, and a peer's request only ever has this node's
// instance.

// RouteConfig is a role's routing settings, read on every request (a
// reload applies at once).
type RouteConfig struct {
	Policy routing.Policy
	Params routing.Params
	// QueueMax bounds the requests held while every candidate is full; 0:
	// none are held (they go to the candidate with the lowest estimate,
	// to wait in its engine's queue). QueueTimeout bounds one's wait.
	QueueMax     int
	QueueTimeout time.Duration
	// PlainAffinity: a key's node is its plain rendezvous peer, not its
	// place in a routing.Placer's bounded placement.
	PlainAffinity bool
}

// PeerState is what the consumer side remembers of a peer's recent
// answers for a role (PeerScorer.State).
type PeerState struct {
	Refused, Cooled bool
	Fails           int
}

// RouteInfo is how a request's candidate was chosen, in the access log,
// in Outcome and in the decision ring behind `infermesh route --request`.
type RouteInfo struct {
	Policy string `json:"policy"`
	// Reason is why the candidate that answered was chosen (routing.Reason,
	// or failover when an earlier one failed before its first byte).
	Reason string `json:"reason"`
	// Key is where the affinity key came from (none, prompt_cache_key,
	// user, prefix); Tokens the prompt's estimated tokens.
	Key    string `json:"key"`
	Tokens int    `json:"tokens"`
	// Queued is how long the request waited for a free slot at this agent.
	Queued time.Duration `json:"queued_ns,omitempty"`
	// Candidates in the order they were to be tried.
	Candidates []RouteCandidate `json:"candidates"`
}

// RouteCandidate is one candidate's part in a decision.
type RouteCandidate struct {
	Target    string        `json:"target"` // "local" or a peer node
	Estimate  time.Duration `json:"estimate_ns"`
	Queue     time.Duration `json:"queue_ns"`
	Prefill   time.Duration `json:"prefill_ns"`
	Network   time.Duration `json:"network_ns"`
	Penalty   time.Duration `json:"penalty_ns,omitempty"`
	Cached    int           `json:"cached_tokens"`
	InFlight  uint32        `json:"in_flight"`
	Slots     uint32        `json:"slots"`
	Full      bool          `json:"full,omitempty"`
	Affine    bool          `json:"affine,omitempty"`
	Estimated bool          `json:"estimated"` // false under local-first: nothing was estimated
}

// router is the proxy's routing state.
type router struct {
	index   *routing.Index
	stats   *routing.Stats
	targets sync.Map // role -> *roleTargets
	qmu     sync.Mutex
	queues  map[string]*routeQueue
	pool    sync.Pool // *routeScratch
}

// target is what the router keeps of one role's target (a peer, or
// "local") beyond the index and the stats.
type target struct {
	key string // targetKey, for the index and the stats
	// mine counts this node's requests in flight to the peer; base is
	// mine when the peer's load as held now (its LoadSeq: an advert or a
	// load report) was taken, which counted them: the peer's load now is
	// what is held less those, plus mine.
	mine atomic.Int64
	mu   sync.Mutex
	seq  uint64
	base int64
	at   time.Time // when seq was first seen
}

// maxTargets bounds the targets kept per role: past it, peers that came
// and went under new names are forgotten, all at once (requests in flight
// then count as ended).
const maxTargets = 1 << 14

// roleTargets is one role's targets, by name, in a map replaced whole when
// a target is added (rare: a peer new to the role), so that the lookups
// of every request, one per candidate, take no lock.
type roleTargets struct {
	role   string
	placer *routing.Placer // the role's key placement
	mu     sync.Mutex      // serializes additions
	m      atomic.Pointer[map[string]*target]
}

func (rt *router) roleTargets(role string) *roleTargets {
	if v, ok := rt.targets.Load(role); ok {
		return v.(*roleTargets)
	}
	r := &roleTargets{role: role, placer: routing.NewPlacer()}
	r.m.Store(&map[string]*target{})
	v, _ := rt.targets.LoadOrStore(role, r)
	return v.(*roleTargets)
}

func (r *roleTargets) get(name string) *target {
	if t := (*r.m.Load())[name]; t != nil {
		return t
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	old := *r.m.Load()
	if t := old[name]; t != nil {
		return t
	}
	next := make(map[string]*target, len(old)+1)
	if len(old) < maxTargets {
		maps.Copy(next, old)
	}
	t := &target{key: targetKey(r.role, name)}
	next[name] = t
	r.m.Store(&next)
	return t
}

func (rt *router) target(role, name string) *target { return rt.roleTargets(role).get(name) }

// indexBlocks bounds the prefix index per target: 4096 blocks of 64
// tokens, 256k tokens, about a large engine's prefix cache. A target that
// advertises its cache size (vLLM's cache_config_info) is held to that.
const (
	indexBlocks = 4096
	blockTokens = 64
	// rttStep: round trips below it count as none, so loopback noise
	// does not order otherwise equal peers.
	rttStep = time.Millisecond
	// queueRecheck is how often the queue's head looks again without a
	// wake-up (a peer's capacity freed that this node did not see end).
	queueRecheck = 25 * time.Millisecond
)

func newRouter() *router {
	return &router{index: routing.NewIndex(indexBlocks), stats: routing.NewStats(), queues: map[string]*routeQueue{}}
}

type routeScratch struct {
	cands  []routing.Cand
	keys   []string // each candidate's targetKey
	order  []int
	ests   []routing.Estimate
	blocks []uint64
}

func targetKey(role, target string) string { return role + "\x00" + target }

func targetOf(c placement.Candidate) string {
	if c.Kind == placement.KindLocal {
		return "local"
	}
	return c.Node
}

// takeReport notes that node's load report for role was taken now, held
// under seq.
func (rt *router) takeReport(role, node string, seq uint64) {
	t := rt.target(role, node)
	t.mu.Lock()
	t.seq, t.base, t.at = seq, t.mine.Load(), time.Now()
	t.mu.Unlock()
}

// reported is this node's count in flight to t when the load held under
// seq was taken: as noted, or, for a seq not seen before (an advert that
// arrived since), mine now; and how long ago that seq was first seen.
func (t *target) reported(seq uint64, mine int64, now time.Time) (int64, time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.seq != seq {
		t.seq, t.base, t.at = seq, mine, now
	}
	return t.base, now.Sub(t.at)
}

// staleLoad is how old a peer's load may be before a full peer this node
// has nothing in flight to is given room for one request: an answer is
// the only report a peer sends between its adverts (seconds apart), so a
// peer left alone because it looked full would look full until its next
// advert, idle all along. The one request's answer brings a fresh report;
// until it does, the peer looks full again. The scrape's interval: the
// serving agent's own view is no fresher.
const staleLoad = 250 * time.Millisecond

// peerInFlight is a peer's requests in flight as this node holds them:
// the others' (the held load, less what this node had in flight when it
// was taken) plus this node's now; a full peer's others' capped below its
// slots when the load is older than staleLoad and this node has none in
// flight to it.
func peerInFlight(held, base, mine int64, age time.Duration, slots uint32) uint32 {
	others := max(held-base, 0)
	if s := int64(slots); mine == 0 && age > staleLoad && s > 0 && others >= s {
		others = s - 1
	}
	return clampU32(others + mine)
}

// routeReq is one request's routing: its prompt, its decision, and what
// forward learns of the outcome.
type routeReq struct {
	info   RouteInfo
	tokens int
	keyed  bool // the request has an affinity key
	blocks []uint64
	ests   []routing.Estimate // by position in the ordered candidates
	queued bool
	q      *routeQueue
	s      *routeScratch
}

// resolveForApp is role's candidates for an app's request: unordered when
// the routing policy orders them itself (auto) and the resolver can say
// so, in the resolver's order otherwise.
func (p *Proxy) resolveForApp(role string) []placement.Candidate {
	if u, ok := p.cfg.Resolver.(UnorderedResolver); ok && (p.cfg.Routing == nil || p.cfg.Routing(role).Policy == routing.PolicyAuto) {
		return u.Candidates(role)
	}
	return p.cfg.Resolver.Resolve(role)
}

// route orders cands for an app's request (policy, estimate, affinity)
// and, when every candidate is full, holds it in the role's queue until
// one frees a slot. It returns the candidates in order, or an error to
// answer with (a full queue, a timeout; nil cands with a nil error: the
// client went away while queued).
//
// prio is the client's priority: the queue holds high before normal
// before low, first in first out within each.
func (p *Proxy) route(r *http.Request, role string, body []byte, cands []placement.Candidate, prio clients.Priority) ([]placement.Candidate, *routeReq, *APIError) {
	cfg := RouteConfig{}
	if p.cfg.Routing != nil {
		cfg = p.cfg.Routing(role)
	}
	rt := p.router
	s, _ := rt.pool.Get().(*routeScratch)
	if s == nil {
		s = &routeScratch{}
	}
	rr := &routeReq{s: s, info: RouteInfo{Policy: cfg.Policy.String(), Key: prompt.KeyNone.String()}}
	var req routing.Request
	if cfg.Policy == routing.PolicyAuto {
		chat := r.URL.Path == pathChat
		if chat || r.URL.Path == pathCompletions {
			in := prompt.Parse(body, chat, blockTokens, s.blocks)
			s.blocks = in.Tokens.Blocks
			rr.tokens, rr.blocks = in.Tokens.N, in.Tokens.Blocks
			req = routing.Request{Tokens: in.Tokens.N, Key: in.Key}
			rr.info.Key = in.KeySource.String()
			rr.keyed = in.Key != 0
		}
		if req.Key != 0 && !cfg.PlainAffinity {
			rt.roleTargets(role).placer.Observe(req.Key, time.Now())
		}
	}
	rr.info.Tokens = rr.tokens
	dec := p.decide(role, cfg, cands, req, rr)
	if cfg.QueueMax > 0 && (dec.Full || rt.queue(role).len() > 0) {
		var apiErr *APIError
		cands, dec, apiErr = p.waitForSlot(r, role, cfg, req, rr, prio)
		if apiErr != nil || cands == nil {
			rr.release(rt)
			return nil, nil, apiErr
		}
		rr.queued = true
	}
	out := make([]placement.Candidate, len(cands))
	rr.ests = make([]routing.Estimate, 0, len(cands))
	rr.info.Candidates = make([]RouteCandidate, len(cands))
	for i, ci := range dec.Order {
		out[i] = cands[ci]
		rc := RouteCandidate{Target: targetOf(cands[ci]), InFlight: s.cands[ci].InFlight, Slots: s.cands[ci].Slots, Affine: ci == dec.Affine}
		var e routing.Estimate
		if dec.Estimates != nil {
			e = dec.Estimates[ci]
			rc.Estimated = true
			rc.Estimate, rc.Queue, rc.Prefill, rc.Network, rc.Penalty, rc.Cached, rc.Full = e.Total, e.Queue, e.Prefill, e.Network, e.Penalty, e.Cached, e.Full
		}
		rr.ests = append(rr.ests, e)
		rr.info.Candidates[i] = rc
	}
	rr.info.Reason = string(dec.Reason)
	if rr.queued {
		rr.info.Reason = string(routing.ReasonQueued)
	}
	return out, rr, nil
}

// decide gathers what is known of cands and asks routing.Decide.
func (p *Proxy) decide(role string, cfg RouteConfig, cands []placement.Candidate, req routing.Request, rr *routeReq) routing.Decision {
	rt, s := p.router, rr.s
	s.cands, s.keys = s.cands[:0], s.keys[:0]
	targets := rt.roleTargets(role)
	now := time.Now()
	for _, c := range cands {
		// Running and Waiting stay 0: the counts below are brought up
		// to now, which the instance's own (a scrape or a report old)
		// are not.
		rc := routing.Cand{Local: c.Kind == placement.KindLocal, Node: c.Node, Slots: c.Capacity.Slots}
		tg := targets.get(targetOf(c))
		if rc.Local {
			// This proxy's count is exact and current, the engine's
			// up to a scrape old: what the engine counted beyond this
			// proxy stands for the rest.
			n := p.busy.get(role)
			if p.cfg.ExternalLoad != nil {
				n += p.cfg.ExternalLoad(role)
			}
			rc.InFlight = clampU32(n)
		} else {
			// The peer's load as held (its agent's count or its
			// engine's, the larger) counted what this node had in
			// flight to it then; what this node has now replaces that.
			mine := tg.mine.Load()
			held := max(int64(c.Load), int64(c.Capacity.Running)+int64(c.Capacity.Waiting))
			base, age := tg.reported(c.LoadSeq, mine, now)
			rc.InFlight = peerInFlight(held, base, mine, age, rc.Slots)
			if p.cfg.RTT != nil {
				rc.RTT = p.cfg.RTT(c.Node).Truncate(rttStep)
			}
			if p.cfg.PeerState != nil {
				st := p.cfg.PeerState(c.Node, role)
				rc.Refused, rc.Cooled, rc.Fails = st.Refused, st.Cooled, st.Fails
			}
		}
		s.cands = append(s.cands, rc)
		s.keys = append(s.keys, tg.key)
	}
	// One lock each for every candidate's recent times and cached prefix.
	rt.stats.Fill(s.keys, s.cands)
	if len(rr.blocks) > 0 {
		rt.index.FillCached(s.keys, rr.blocks, blockTokens, s.cands)
	}
	if req.Key != 0 && cfg.Policy == routing.PolicyAuto && !cfg.PlainAffinity {
		req.Place = targets.placer.Place(s.cands, req.Key, now)
	}
	d := routing.Decide(cfg.Policy, s.cands, req, cfg.Params, s.order, s.ests)
	s.order, s.ests = d.Order, d.Estimates
	return d
}

func clampU32(n int64) uint32 { return uint32(min(max(n, 0), 1<<32-1)) }

// dispatched counts a request sent to target (a peer: until done is
// called) and wakes the role's queue: the next in line decides with this
// one counted.
func (p *Proxy) dispatched(role string, c placement.Candidate) (done func()) {
	done = func() {}
	if c.Kind == placement.KindRemote {
		t := p.router.target(role, c.Node)
		t.mine.Add(1)
		done = func() { t.mine.Add(-1) }
	}
	return done
}

// learn records what an answered attempt showed: the prefix the target
// now caches, and, for a request that found a free slot, its time to the
// first byte (the prefill cost per token).
func (rr *routeReq) learn(rt *router, role string, c placement.Candidate, pos int, ttfb time.Duration, status int) {
	if status != http.StatusOK {
		return
	}
	k := rt.target(role, targetOf(c)).key
	// A keyed request served off its key's node (a spill, a failover) is
	// not recorded: that node caches the prompt too, but only until the
	// tenants it is the node of (sent by every consumer, most unseen
	// here) evict it, and an index that believed it would make the next
	// spill look cheap and spread the tenant over every cache.
	if len(rr.blocks) > 0 && (!rr.keyed || (pos < len(rr.info.Candidates) && rr.info.Candidates[pos].Affine)) {
		rt.index.Record(k, rr.blocks, int(c.Capacity.CacheTokens/blockTokens))
	}
	if pos < len(rr.ests) && !rr.queued && rr.ests[pos].Queue == 0 && rr.ests[pos].Prefill > 0 {
		if unc := rr.tokens - rr.ests[pos].Cached; unc >= blockTokens {
			rt.stats.ObserveFirstToken(k, ttfb-rr.ests[pos].Network, unc)
		}
	}
}

// finish records the service time of a request that found a free slot.
func (rr *routeReq) finish(rt *router, role string, c placement.Candidate, pos int, d time.Duration) {
	if pos < len(rr.ests) && !rr.queued && rr.ests[pos].Queue == 0 {
		rt.stats.ObserveService(rt.target(role, targetOf(c)).key, d)
	}
}

func (rr *routeReq) release(rt *router) {
	if rr.s != nil {
		rr.s.cands, rr.s.keys = rr.s.cands[:0], rr.s.keys[:0]
		rt.pool.Put(rr.s)
		rr.s = nil
	}
	rr.blocks = nil
}

// waitForSlot holds the request in role's queue, by priority then first
// in first out, until a candidate has a free slot; the head decides again whenever a
// request of the role is dispatched or ends, a load report arrives, or
// queueRecheck passes.
func (p *Proxy) waitForSlot(r *http.Request, role string, cfg RouteConfig, req routing.Request, rr *routeReq, prio clients.Priority) ([]placement.Candidate, routing.Decision, *APIError) {
	q := p.router.queue(role)
	w, ok := q.join(cfg.QueueMax, prio)
	if !ok {
		return nil, routing.Decision{}, errQueueFull(role, cfg.QueueMax)
	}
	rr.q = q
	start := time.Now()
	timeout := cfg.QueueTimeout
	if timeout <= 0 {
		timeout = DefaultQueueTimeout
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(queueRecheck)
	defer tick.Stop()
	for {
		if q.head(w) {
			cands := p.cfg.Resolver.Resolve(role)
			if len(cands) == 0 {
				q.leave(w, true)
				return nil, routing.Decision{}, errNoInstance(role)
			}
			if d := p.decide(role, cfg, cands, req, rr); !d.Full || len(cands) == 1 {
				// Leave without waking the next: forward wakes it
				// once this one is counted at its candidate.
				q.leave(w, false)
				rr.info.Queued = time.Since(start)
				return cands, d, nil
			}
		}
		select {
		case <-w.wake:
		case <-tick.C:
		case <-deadline.C:
			q.leave(w, true)
			return nil, routing.Decision{}, errQueueTimeout(role, timeout)
		case <-r.Context().Done():
			q.leave(w, true)
			return nil, routing.Decision{}, nil
		}
	}
}

// DefaultQueueTimeout is routing.queue.timeout's default.
const DefaultQueueTimeout = 30 * time.Second

func errQueueFull(role string, max int) *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "server_busy", RetryAfter: 1,
		Message: "every instance of role " + strconv.Quote(role) + " is at capacity and its queue is full (" + strconv.Itoa(max) + " waiting); retry shortly"}
}

func errQueueTimeout(role string, d time.Duration) *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "server_busy", RetryAfter: 1,
		Message: "every instance of role " + strconv.Quote(role) + " stayed at capacity for " + d.String() + " while the request waited; retry shortly"}
}

// QueueLen is how many requests for role wait for a free slot now.
func (p *Proxy) QueueLen(role string) int { return p.router.queue(role).len() }

// QueueLens is how many requests wait in each role's queue now (roles
// that ever queued).
func (p *Proxy) QueueLens() map[string]int {
	p.router.qmu.Lock()
	defer p.router.qmu.Unlock()
	out := make(map[string]int, len(p.router.queues))
	for role, q := range p.router.queues {
		out[role] = q.len()
	}
	return out
}

// kick wakes role's queue head, if any.
func (p *Proxy) kick(role string) {
	p.router.qmu.Lock()
	q := p.router.queues[role]
	p.router.qmu.Unlock()
	if q != nil {
		q.kick()
	}
}

func (rt *router) queue(role string) *routeQueue {
	rt.qmu.Lock()
	defer rt.qmu.Unlock()
	q := rt.queues[role]
	if q == nil {
		q = &routeQueue{}
		rt.queues[role] = q
	}
	return q
}

// routeQueue is one role's queue of requests waiting for a slot.
type routeQueue struct {
	mu      sync.Mutex
	waiters []*waiter
	n       atomic.Int32
}

type waiter struct {
	wake chan struct{}
	prio clients.Priority
}

func (q *routeQueue) len() int { return int(q.n.Load()) }

// join adds a waiter behind every waiter of its priority or higher;
// false when max are waiting. One that joins ahead of the head decides
// at once (waitForSlot looks before it waits); the head it passed waits
// on.
func (q *routeQueue) join(max int, prio clients.Priority) (*waiter, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) >= max {
		return nil, false
	}
	w := &waiter{wake: make(chan struct{}, 1), prio: prio}
	i := len(q.waiters)
	for i > 0 && q.waiters[i-1].prio < prio {
		i--
	}
	q.waiters = slices.Insert(q.waiters, i, w)
	q.n.Store(int32(len(q.waiters)))
	return w, true
}

func (q *routeQueue) head(w *waiter) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters) > 0 && q.waiters[0] == w
}

// leave removes w; wake: wake the (new) head, as when w gives up its place.
func (q *routeQueue) leave(w *waiter, wake bool) {
	q.mu.Lock()
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			break
		}
	}
	q.n.Store(int32(len(q.waiters)))
	q.mu.Unlock()
	if wake {
		q.kick()
	}
}

func (q *routeQueue) kick() {
	q.mu.Lock()
	var h *waiter
	if len(q.waiters) > 0 {
		h = q.waiters[0]
	}
	q.mu.Unlock()
	if h != nil {
		select {
		case h.wake <- struct{}{}:
		default:
		}
	}
}
