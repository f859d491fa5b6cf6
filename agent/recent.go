package agent

import (
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
