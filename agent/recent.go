package agent

import (
	"context"
	"sync"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/proxy"
)

// The recent requests: a bounded ring of the last requests the proxy
// finished (the apps' and the peers'), for the console's list. It is fed
// by the proxy's Observer beside the metrics: one lock and one copy per
// request, nothing when nobody reads it but the copy.

// recentSize is how many requests the ring keeps.
const recentSize = 256

type recentRing struct {
	mu   sync.Mutex
	buf  [recentSize]admin.RecentRequest
	next int    // where the next one goes
	n    uint64 // requests recorded so far
}

func (r *recentRing) add(o proxy.Outcome, now time.Time) {
	rr := admin.RecentRequest{
		Time: now.UTC(), ID: o.RequestID, Role: o.Role, Source: o.Source, Target: o.Target, Status: o.Status,
		DurationMillis: float64(o.Duration.Microseconds()) / 1000, Attempts: o.Attempts, Aborted: o.Aborted,
		PromptTokens: o.PromptTokens, CompletionTokens: o.CompletionTokens,
	}
	if o.FirstEvent > 0 {
		rr.TTFTMillis = float64(o.FirstEvent.Microseconds()) / 1000
	}
	if o.Route != nil {
		rr.Route = routeDecision(o, rr.Time)
	}
	r.mu.Lock()
	r.buf[r.next] = rr
	r.next = (r.next + 1) % recentSize
	r.n++
	r.mu.Unlock()
}

// list returns the kept requests, newest first.
func (r *recentRing) list() []admin.RecentRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := int(min(r.n, recentSize))
	out := make([]admin.RecentRequest, 0, n)
	for i := 1; i <= n; i++ {
		out = append(out, r.buf[(r.next-i+recentSize)%recentSize])
	}
	return out
}

// observers is the proxy's Observer: the metrics, and the ring of recent
// requests.
type observers struct {
	proxy.Observer
	recent *recentRing
}

func (o observers) Done(out proxy.Outcome) {
	o.Observer.Done(out)
	o.recent.add(out, time.Now())
}

// RecentRequests lists the last requests the proxy finished, newest first.
func (a *Agent) RecentRequests() []admin.RecentRequest { return a.recent.list() }

// find returns the kept request id of role, newest first.
func (r *recentRing) find(role, id string) (admin.RecentRequest, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := int(min(r.n, recentSize))
	for i := 1; i <= n; i++ {
		if e := r.buf[(r.next-i+recentSize)%recentSize]; e.ID == id && e.Role == role {
			return e, true
		}
	}
	return admin.RecentRequest{}, false
}

func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// routeDecision is o's route as the admin API shows it.
func routeDecision(o proxy.Outcome, at time.Time) *admin.RouteDecision {
	ri := o.Route
	d := &admin.RouteDecision{ID: o.RequestID, Role: o.Role, Time: at, Policy: ri.Policy, Reason: ri.Reason,
		Key: ri.Key, Tokens: ri.Tokens, QueuedMillis: millis(ri.Queued), Target: o.Target, Status: o.Status,
		Candidates: make([]admin.RouteEstimate, len(ri.Candidates))}
	for i, c := range ri.Candidates {
		d.Candidates[i] = admin.RouteEstimate{Target: c.Target, Estimated: c.Estimated,
			EstimateMillis: millis(c.Estimate), QueueMillis: millis(c.Queue), PrefillMillis: millis(c.Prefill),
			NetworkMillis: millis(c.Network), PenaltyMillis: millis(c.Penalty), CachedTokens: c.Cached,
			InFlight: c.InFlight, Slots: c.Slots, Full: c.Full, Affine: c.Affine}
	}
	return d
}

// RouteRequest implements admin.RouteRequester: the decision for request
// id of role, while the ring of recent requests holds it.
func (b *Backend) RouteRequest(_ context.Context, role, id string) (admin.RouteDecision, error) {
	e, ok := b.a.recent.find(role, id)
	switch {
	case !ok:
		return admin.RouteDecision{}, admin.Errorf(admin.ErrNotFound,
			"no request %q of role %q among the last %d this agent finished", id, role, recentSize)
	case e.Route == nil:
		return admin.RouteDecision{}, admin.Errorf(admin.ErrNotFound,
			"request %q of role %q had one candidate (target %q): nothing was decided", id, role, e.Target)
	}
	return *e.Route, nil
}
