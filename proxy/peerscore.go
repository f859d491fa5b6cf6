package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/placement"
)

// PeerScoreConfig configures a PeerScorer. Zero values mean the defaults.
type PeerScoreConfig struct {
	// FailureThreshold is how many consecutive failures cool a peer down.
	// Default 3.
	FailureThreshold int
	// Cooldown is how long a cooled-down peer is tried after every other
	// candidate. A failure while cooled down starts the period again; one
	// success ends it. Default 10s.
	Cooldown time.Duration
	// RefusalMemory is how long a peer agent's refusal of a role (a
	// RefusedHeader answer) puts that peer last for that role. A success
	// for the role ends it. Default 60s.
	RefusalMemory time.Duration
	// Now is the clock. Nil means time.Now.
	Now func() time.Time
	// Graceful reports errors that ended an attempt because the peer shut
	// down in order (the mesh's mesh.GracefulClose): they count as no
	// failure, so a peer that drained and restarted is not cooled down
	// when it comes back. Nil: every error is a failure.
	Graceful func(error) bool
	// Alive asks a peer's agent, over the connection attempts use, whether
	// it is alive (mesh.Transport.ConfirmAlive); it must return when ctx
	// ends. With it, an attempt that has no response headers after a third
	// of FirstByte asks, and waits the rest of FirstByte for the answer: a
	// peer that answers is alive (a slow model, not a frozen peer) and the
	// attempt waits on, asking again every FirstByte; one that does not
	// answer is making no progress: the attempt ends with ErrNoProgress
	// and the peer is cooled down at once, for every request. A silent
	// peer is so left within FirstByte. Nil: attempts wait for the
	// transport alone (its idle timeout).
	Alive func(ctx context.Context, node string) error
	// FirstByte bounds how long a peer that answers nothing holds an
	// attempt (see Alive). Default 750ms.
	FirstByte time.Duration
	// HeaderTimeout bounds the whole wait for an attempt's response
	// headers, as Config.UpstreamTimeout bounds a local instance's: a peer
	// that answers its liveness probes but sends no headers (a hostile
	// one, or one whose own bound is longer) holds the attempt this long
	// at most. The attempt then ends with ErrHeaderTimeout, a failure of
	// the peer like any other, and the next candidate is tried. Default
	// 5m.
	HeaderTimeout time.Duration
}

// ErrHeaderTimeout ends an attempt to a peer that sent no response headers
// within HeaderTimeout. It is a timeout (errors.Is context.DeadlineExceeded).
var ErrHeaderTimeout = fmt.Errorf("peer sent no response headers within the upstream timeout: %w", context.DeadlineExceeded)

// ErrNoProgress ends an attempt to a peer whose agent had not sent
// response headers and did not answer a liveness probe either (frozen,
// unplugged, or its connection broke without a word).
var ErrNoProgress = errors.New("peer made no progress: no response headers and no answer to a liveness probe")

// DefaultPeerScoreConfig returns the defaults.
func DefaultPeerScoreConfig() PeerScoreConfig {
	return PeerScoreConfig{FailureThreshold: 3, Cooldown: 10 * time.Second, RefusalMemory: time.Minute,
		FirstByte: 750 * time.Millisecond, HeaderTimeout: 5 * time.Minute, Now: time.Now}
}

// PeerScorer is the consumer side's view of its peers. As a Resolver it
// wraps another (placement) and reorders the remote candidates: peers whose
// agent recently refused the role (RefusedHeader) go last, then peers
// cooled down after repeated failures; the others by the load they
// advertise plus the requests we have in flight to them, then by recent
// failures; ties keep the wrapped order. Local candidates keep their place
// (first). As a RoundTripper wrapper (Transport) it observes every remote
// attempt: in flight until the response body is closed, a failure when no
// response came (dial error, refused handshake, reset), when the peer
// answered 502, 503 or 504, or when the stream broke mid-way; a client that
// went away is no one's failure.
//
// All methods are safe for concurrent use and never block on I/O.
type PeerScorer struct {
	inner Resolver
	cfg   PeerScoreConfig

	mu    sync.Mutex
	peers map[string]*peerStat
}

type peerStat struct {
	inflight  int64
	fails     int // consecutive
	lastFail  time.Time
	coolUntil time.Time
	refused   map[string]Refusal // by role
}

// Refusal is a peer agent's refusal of a role, as the scorer remembers it.
type Refusal struct {
	Why string    // the RefusedHeader value: RefusedNotServed, ...
	At  time.Time // the last one
}

// recentFails is the consecutive failure count, forgotten a cool-down
// period after the last failure (or after the end of the cool-down it
// caused): an old blip does not keep a peer behind its equals forever,
// while a peer that fails again as soon as its cool-down ends is cooled
// down again at once.
func (p *peerStat) recentFails(now time.Time, cooldown time.Duration) int {
	ref := p.lastFail
	if p.coolUntil.After(ref) {
		ref = p.coolUntil
	}
	if now.Sub(ref) > cooldown {
		return 0
	}
	return p.fails
}

var _ Resolver = (*PeerScorer)(nil)

// NewPeerScorer wraps inner.
func NewPeerScorer(inner Resolver, cfg PeerScoreConfig) (*PeerScorer, error) {
	if inner == nil {
		return nil, errors.New("peer score config: inner Resolver is required")
	}
	d := DefaultPeerScoreConfig()
	if cfg.FailureThreshold < 0 {
		return nil, errors.New("peer score config: FailureThreshold is negative")
	}
	if cfg.Cooldown < 0 {
		return nil, errors.New("peer score config: Cooldown is negative")
	}
	if cfg.RefusalMemory < 0 {
		return nil, errors.New("peer score config: RefusalMemory is negative")
	}
	if cfg.FirstByte < 0 {
		return nil, errors.New("peer score config: FirstByte is negative")
	}
	if cfg.HeaderTimeout < 0 {
		return nil, errors.New("peer score config: HeaderTimeout is negative")
	}
	defaults.Zero(&cfg.FirstByte, d.FirstByte)
	defaults.Zero(&cfg.HeaderTimeout, d.HeaderTimeout)
	if cfg.RefusalMemory == 0 {
		cfg.RefusalMemory = d.RefusalMemory
	}
	if cfg.FailureThreshold == 0 {
		cfg.FailureThreshold = d.FailureThreshold
	}
	if cfg.Cooldown == 0 {
		cfg.Cooldown = d.Cooldown
	}
	if cfg.Now == nil {
		cfg.Now = d.Now
	}
	return &PeerScorer{inner: inner, cfg: cfg, peers: map[string]*peerStat{}}, nil
}

// Candidates is inner's candidates unordered, when inner can give them so
// (an UnorderedResolver), else its Resolve: for the routing policy auto,
// which orders them itself and reads each peer's state (State) as it
// does.
func (s *PeerScorer) Candidates(role string) []placement.Candidate {
	if u, ok := s.inner.(UnorderedResolver); ok {
		return u.Candidates(role)
	}
	return s.inner.Resolve(role)
}

// Resolve returns inner's candidates with the remote ones reordered.
func (s *PeerScorer) Resolve(role string) []placement.Candidate {
	cands := s.inner.Resolve(role)
	first, n := -1, 0
	for i, c := range cands {
		if c.Kind == placement.KindRemote {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	if n < 2 {
		return cands
	}
	type keyed struct {
		c       placement.Candidate
		refused bool
		cooled  bool
		load    int64
		fails   int
	}
	ks := make([]keyed, 0, n)
	now := s.cfg.Now()
	s.mu.Lock()
	for _, c := range cands {
		if c.Kind != placement.KindRemote {
			continue
		}
		k := keyed{c: c, load: int64(c.Load)}
		if p := s.peers[c.Node]; p != nil {
			k.cooled = now.Before(p.coolUntil)
			k.refused = p.refusedFor(role, now, s.cfg.RefusalMemory)
			k.load += p.inflight
			k.fails = p.recentFails(now, s.cfg.Cooldown)
		}
		ks = append(ks, k)
	}
	s.mu.Unlock()
	slices.SortStableFunc(ks, func(a, b keyed) int {
		if a.refused != b.refused {
			if a.refused {
				return 1
			}
			return -1
		}
		if a.cooled != b.cooled {
			if a.cooled {
				return 1
			}
			return -1
		}
		if d := cmp.Compare(a.load, b.load); d != 0 {
			return d
		}
		return cmp.Compare(a.fails, b.fails)
	})
	// Write back into the remote positions, locals untouched.
	j := 0
	for i := first; i < len(cands); i++ {
		if cands[i].Kind == placement.KindRemote {
			cands[i] = ks[j].c
			j++
		}
	}
	return cands
}

// refusedFor reports whether the peer refused role within memory.
func (p *peerStat) refusedFor(role string, now time.Time, memory time.Duration) bool {
	r, ok := p.refused[role]
	return ok && now.Sub(r.At) < memory
}

// ObserveRefusal records that node's agent refused role (why is the
// RefusedHeader value): for RefusalMemory it is tried after every other
// candidate for that role. The peer answered, so it is no failure.
func (s *PeerScorer) ObserveRefusal(node, role, why string) {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.statLocked(node)
	if p.refused == nil {
		p.refused = map[string]Refusal{}
	}
	p.refused[role] = Refusal{Why: why, At: now}
}

// Refused returns node's remembered refusal of role, if any is recent.
func (s *PeerScorer) Refused(node, role string) (Refusal, bool) {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.peers[node]
	if p == nil || !p.refusedFor(role, now, s.cfg.RefusalMemory) {
		return Refusal{}, false
	}
	return p.refused[role], true
}

// servedRole forgets node's refusal of role: it just served it.
func (s *PeerScorer) servedRole(node, role string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.peers[node]; p != nil {
		delete(p.refused, role)
	}
}

func (s *PeerScorer) statLocked(node string) *peerStat {
	p := s.peers[node]
	if p == nil {
		p = &peerStat{}
		s.peers[node] = p
	}
	return p
}

// Observe records the outcome of one attempt to node: ok resets its failure
// count and ends any cool-down; a failure counts towards (or extends) one.
func (s *PeerScorer) Observe(node string, ok bool) {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.statLocked(node)
	if ok {
		p.fails = 0
		p.coolUntil = time.Time{}
		return
	}
	p.fails = p.recentFails(now, s.cfg.Cooldown) + 1
	p.lastFail = now
	if p.fails >= s.cfg.FailureThreshold {
		p.coolUntil = now.Add(s.cfg.Cooldown)
	}
}

// Stalled cools node down at once: an attempt saw no progress on its
// connection. Every request orders it after the others until the
// cool-down ends or an attempt to it succeeds.
func (s *PeerScorer) Stalled(node string) {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.statLocked(node)
	p.fails = max(p.recentFails(now, s.cfg.Cooldown)+1, s.cfg.FailureThreshold)
	p.lastFail = now
	p.coolUntil = now.Add(s.cfg.Cooldown)
}

func (s *PeerScorer) graceful(err error) bool {
	return s.cfg.Graceful != nil && s.cfg.Graceful(err)
}

func (s *PeerScorer) begin(node string) {
	s.mu.Lock()
	s.statLocked(node).inflight++
	s.mu.Unlock()
}

func (s *PeerScorer) end(node string) {
	s.mu.Lock()
	s.statLocked(node).inflight--
	s.mu.Unlock()
}

// PeerScore is one peer as the scorer sees it.
type PeerScore struct {
	Node       string
	InFlight   int64
	Failures   int // consecutive, within the cool-down period of each other
	CooledDown bool
	CoolUntil  time.Time // zero when not cooled down
}

// Peers returns every peer observed so far, sorted by node.
func (s *PeerScorer) Peers() []PeerScore {
	now := s.cfg.Now()
	s.mu.Lock()
	out := make([]PeerScore, 0, len(s.peers))
	for n, p := range s.peers {
		ps := PeerScore{Node: n, InFlight: p.inflight, Failures: p.recentFails(now, s.cfg.Cooldown)}
		if now.Before(p.coolUntil) {
			ps.CooledDown, ps.CoolUntil = true, p.coolUntil
		}
		out = append(out, ps)
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b PeerScore) int { return cmp.Compare(a.Node, b.Node) })
	return out
}

// Transport wraps the mesh RoundTripper (requests to https://<node id>/...)
// so that every attempt is observed.
func (s *PeerScorer) Transport(rt http.RoundTripper) http.RoundTripper {
	return &scoredTransport{s: s, rt: rt}
}

type scoredTransport struct {
	s  *PeerScorer
	rt http.RoundTripper
}

func (t *scoredTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	node := r.URL.Host
	t.s.begin(node)
	resp, err := t.roundTrip(r, node)
	if err != nil {
		t.s.end(node)
		switch {
		case errors.Is(err, ErrNoProgress):
			t.s.Stalled(node)
		case r.Context().Err() == nil && !t.s.graceful(err):
			t.s.Observe(node, false)
		}
		return nil, err
	}
	role := r.Header.Get(RoleHeader)
	switch {
	case resp.Header.Get(RefusedHeader) != "":
		t.s.Observe(node, true) // it answered: reachable, only unwilling
		t.s.ObserveRefusal(node, role, resp.Header.Get(RefusedHeader))
	case resp.StatusCode == http.StatusBadGateway, resp.StatusCode == http.StatusServiceUnavailable, resp.StatusCode == http.StatusGatewayTimeout:
		t.s.Observe(node, false)
	default:
		t.s.Observe(node, true)
		if resp.StatusCode < 300 {
			t.s.servedRole(node, role)
		}
	}
	resp.Body = &scoredBody{ReadCloser: resp.Body, s: t.s, node: node, ctx: r.Context()}
	return resp, nil
}

// roundTrip sends r, bounding the wait for its response headers by
// HeaderTimeout and watching for progress meanwhile
// (PeerScoreConfig.Alive).
func (t *scoredTransport) roundTrip(r *http.Request, node string) (*http.Response, error) {
	ctx, cancel := context.WithCancelCause(r.Context())
	bound := time.AfterFunc(t.s.cfg.HeaderTimeout, func() { cancel(ErrHeaderTimeout) })
	headers := make(chan struct{})
	watched := make(chan struct{})
	if t.s.cfg.Alive != nil {
		go func() {
			defer close(watched)
			t.watch(ctx, node, headers, cancel)
		}()
	} else {
		close(watched)
	}
	resp, err := t.rt.RoundTrip(r.WithContext(ctx))
	if !bound.Stop() && err == nil {
		// The bound ended the attempt's context as the headers came: its
		// body would fail on the first read.
		_ = resp.Body.Close()
		resp, err = nil, context.Cause(ctx)
	}
	close(headers)
	<-watched
	if err != nil {
		if cause := context.Cause(ctx); r.Context().Err() == nil &&
			(errors.Is(cause, ErrNoProgress) || errors.Is(cause, ErrHeaderTimeout)) {
			err = fmt.Errorf("peer %q: %w", node, cause)
		}
		cancel(nil)
		return nil, err
	}
	// The body reads under ctx: cancelled when it is closed or read to
	// the end (scoredBody), or with the request.
	resp.Body = &cancelBody{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

// watch probes node until headers is closed: first after a third of
// FirstByte, then every FirstByte; a probe that gets no answer within the
// other two thirds cancels the attempt.
func (t *scoredTransport) watch(ctx context.Context, node string, headers <-chan struct{}, cancel context.CancelCauseFunc) {
	period := t.s.cfg.FirstByte
	first := period / 3
	answer := period - first
	tm := time.NewTimer(first)
	defer tm.Stop()
	for {
		select {
		case <-headers:
			return
		case <-ctx.Done():
			return
		case <-tm.C:
		}
		pctx, pcancel := context.WithTimeout(ctx, answer)
		err := t.s.cfg.Alive(pctx, node)
		pcancel()
		select {
		case <-headers:
			return // the answer came meanwhile
		default:
		}
		if err != nil {
			if ctx.Err() == nil {
				// The probe's own error says why (no answer in time, the
				// connection gone, ...): the attempt's log carries it.
				cancel(fmt.Errorf("%w (probe: %v)", ErrNoProgress, err))
			}
			return
		}
		tm.Reset(period)
	}
}

// cancelBody ends its attempt's context when the body is closed.
type cancelBody struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

func (b *cancelBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

// scoredBody keeps its request counted in flight until it is closed or read
// to the end, and counts a stream that breaks as the peer's failure.
type scoredBody struct {
	io.ReadCloser
	s    *PeerScorer
	node string
	ctx  context.Context
	done atomic.Bool
}

func (b *scoredBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.finish(err == io.EOF || b.ctx.Err() != nil || b.s.graceful(err))
	}
	return n, err
}

func (b *scoredBody) Close() error {
	err := b.ReadCloser.Close()
	b.finish(true)
	return err
}

func (b *scoredBody) finish(ok bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	b.s.end(b.node)
	if !ok {
		b.s.Observe(b.node, false)
	}
}

// State is what the scorer remembers of node for role now: a recent
// refusal of the role, a cool-down, recent consecutive failures. The
// router makes the peer's estimate worse by them (routing.Cand).
func (s *PeerScorer) State(node, role string) PeerState {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.peers[node]
	if p == nil {
		return PeerState{} // most peers: nothing to remember, no clock read
	}
	now := s.cfg.Now()
	return PeerState{Refused: p.refusedFor(role, now, s.cfg.RefusalMemory), Cooled: now.Before(p.coolUntil), Fails: p.recentFails(now, s.cfg.Cooldown)}
}
