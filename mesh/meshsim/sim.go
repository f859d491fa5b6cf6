package meshsim

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/mesh/meshbench"
	"github.com/infermesh/infermesh/placement"
)

// Options is one simulation.
type Options struct {
	// N is the number of nodes (at least 2).
	N int
	// Tune adjusts mesh.DefaultConfig (the LAN profile); nil keeps it.
	Tune func(*mesh.Config)
	// Latency, Jitter and Loss configure the network (see Network).
	Latency, Jitter time.Duration
	Loss            float64
	// Window is how long steady-state traffic is measured after the advert
	// reached everyone, in simulated time. Default 5s.
	Window time.Duration
	// Settle is how long to wait, in simulated time, after the advert
	// reached everyone before Window starts. After a whole fleet formed at
	// once, memberlist keeps retransmitting every member's alive message
	// (RetransmitMult x log10(N+1) times each, a few per packet) for about
	// N/5 simulated seconds; a Window right after formation measures that
	// drain, one after Settle the quiet mesh. Default 0.
	Settle time.Duration
	// TimeScale dilates time: every protocol interval and timeout of the
	// mesh config (after Tune), the network's latency and jitter and
	// Window are multiplied by it, and every figure is reported in
	// simulated time (durations divided by it, rates multiplied). A real
	// fleet has a CPU per node; here N nodes share the host's, and at
	// TimeScale 1 a large N starves them (packets queue, probes time out,
	// nodes are wrongly declared dead), which measures the host, not the
	// protocol. Dilated, each node gets TimeScale times the CPU per
	// protocol round. What it cannot dilate: memberlist's and the mesh's
	// fixed constants (EarlyAdvertHold, the once-a-second re-advertise of
	// peers back alive), which become shorter in simulated time. Default 1.
	TimeScale float64
	// LoadEvery, when above 0, changes the origin's load and capacity
	// (in-flight count, running, waiting, KV use: what an engine under
	// traffic reports) every LoadEvery of simulated time, from the advert
	// reaching everyone to the end of Window, so that Window's advert
	// bytes are those of a serving node whose load moves. 0: the load
	// never changes (adverts are refreshes only).
	LoadEvery time.Duration
	// Logf, when set, hears progress.
	Logf func(format string, args ...any)
}

// TimeScaleFor is the TimeScale the benchmarks use for n nodes: n/25, at
// least 1, so that the CPU per node and simulated second stays that of 25
// nodes at scale 1: measured, 100 undilated nodes need about 0.4 of a core
// and starve on a shared 2-core host with a load average of 10.
func TimeScaleFor(n int) float64 { return max(1, float64(n)/25) }

// Result is what a simulation measured.
type Result struct {
	N int
	// TimeScale is the dilation used (Options.TimeScale, at least 1).
	TimeScale float64
	// Membership is the time from the first join until every node lists
	// every other.
	Membership time.Duration
	// Advert is the time from the origin starting to serve a role until
	// every node resolves it.
	Advert time.Duration
	// AdvertQueueMax is the longest advert broadcast queue of any node
	// when the advert had reached everyone (a starving queue grows).
	AdvertQueueMax int
	// AdvertQueueEnd is the longest advert broadcast queue of any node at
	// the end of Window: a queue that starves (memberlist's own
	// broadcasts taking every packet) would still hold adverts there.
	AdvertQueueEnd int
	// FormPushPulls is how many anti-entropy push/pulls the nodes started
	// (mesh.GossipStats) until membership was complete, all nodes together;
	// SteadyPushPulls over Window.
	FormPushPulls, SteadyPushPulls uint64
	// Steady-state bytes sent per node per second over Window: every
	// gossip byte, and the advert part of it (broadcasts and push/pull
	// state); the rest is membership.
	BytesPerNodeSec, AdvertBytesPerNodeSec float64
	// AdvertBroadcastBytesPerNodeSec is the broadcast part of the
	// adverts' bytes (the rest rides push/pull state exchanges).
	AdvertBroadcastBytesPerNodeSec float64
	// FormBytesPerNode is what each node sent, on average, from the first
	// join until membership was complete.
	FormBytesPerNode float64
	// HeapPerNode is the live heap after membership formed, over N.
	HeapPerNode uint64
	// Net counts lost and overflowed packets over the whole run.
	Net Stats
	// Refusals sums every node's refusal counters.
	Refusals map[string]uint64
	// LoadChanges is how many times the origin's load changed
	// (Options.LoadEvery). LoadStale is, over the other nodes at the end
	// of Window, the longest time (simulated) since the load each held
	// stopped being the origin's: 0 when every node holds the latest;
	// LoadMissing how many held none from a change.
	LoadChanges, LoadMissing int
	LoadStale                time.Duration
}

func (r Result) String() string {
	return fmt.Sprintf("N=%d time_scale=%g membership=%v advert=%v advert_queue_max=%d advert_queue_end=%d push/pulls=%d+%d bytes/node/s=%.0f (adverts %.0f, membership %.0f) form_bytes/node=%.0f heap/node=%d KiB lost=%d overflows=%d refusals=%v",
		r.N, r.TimeScale, r.Membership.Round(time.Millisecond), r.Advert.Round(time.Millisecond), r.AdvertQueueMax, r.AdvertQueueEnd, r.FormPushPulls, r.SteadyPushPulls,
		r.BytesPerNodeSec, r.AdvertBytesPerNodeSec, r.BytesPerNodeSec-r.AdvertBytesPerNodeSec,
		r.FormBytesPerNode, r.HeapPerNode/1024, r.Net.Lost, r.Net.Overflows, r.Refusals) +
		fmt.Sprintf(" advert_broadcasts/node/s=%.0f load_changes=%d load_stale=%v load_missing=%d", r.AdvertBroadcastBytesPerNodeSec, r.LoadChanges, r.LoadStale.Round(time.Millisecond), r.LoadMissing)
}

// Run simulates opt.N nodes over one in-memory Network. A phase that
// fails keeps the figures of the earlier ones.
func Run(ctx context.Context, opt Options) (res Result, err error) {
	res.N = opt.N
	res.TimeScale = max(opt.TimeScale, 1)
	defaults.Positive(&opt.Window, 5*time.Second)
	k := max(opt.TimeScale, 1)
	dilate := func(d time.Duration) time.Duration { return time.Duration(float64(d) * k) }
	sim := func(d time.Duration) time.Duration { return time.Duration(float64(d) / k) }
	tune := func(c *mesh.Config) {
		if opt.Tune != nil {
			opt.Tune(c)
		}
		for _, d := range []*time.Duration{&c.AdvertTTL, &c.GossipInterval, &c.ProbeInterval, &c.ProbeTimeout,
			&c.PushPullInterval, &c.AntiEntropyInterval, &c.TCPTimeout, &c.JoinBackoff, &c.JoinMaxBackoff,
			&c.RejoinInterval, &c.RejoinMaxBackoff, &c.ReconnectTimeout, &c.ConfirmTimeout, &c.ConfirmInterval} {
			*d = dilate(*d)
		}
		// A budget of bytes per second, in simulated seconds.
		if c.AdvertLoadBudget > 0 {
			c.AdvertLoadBudget = max(1, int(float64(c.AdvertLoadBudget)/k))
		}
	}
	nw := &Network{Latency: dilate(opt.Latency), Jitter: dilate(opt.Jitter), Loss: opt.Loss}
	ts := make([]*Transport, opt.N)
	heap0 := liveHeap()
	c, err := meshbench.NewCluster(opt.N, tune, func(i int) memberlist.Transport {
		ts[i] = nw.NewTransport()
		return ts[i]
	})
	if err != nil {
		return res, err
	}
	c.Logf = opt.Logf
	defer func() {
		if cerr := c.Close(); err == nil {
			err = cerr
		}
		res.Net = nw.Stats()
	}()
	var broadcasts uint64
	sent := func() (all, adverts, pushPulls uint64) {
		broadcasts = 0
		for i, t := range ts {
			all += t.BytesSent()
			s := c.Meshes[i].GossipStats()
			adverts += s.AdvertBroadcastBytes + s.AdvertStateBytes
			broadcasts += s.AdvertBroadcastBytes
			pushPulls += s.AntiEntropyPushPulls
		}
		return all, adverts, pushPulls
	}

	if res.Membership, err = c.Form(ctx); err != nil {
		return res, err
	}
	res.Membership = sim(res.Membership)
	formed, _, pp := sent()
	res.FormPushPulls = pp
	res.FormBytesPerNode = float64(formed) / float64(opt.N)
	if h := liveHeap(); h > heap0 {
		res.HeapPerNode = (h - heap0) / uint64(opt.N)
	}
	if res.Advert, err = c.Advertise(ctx); err != nil {
		return res, err
	}
	res.Advert = sim(res.Advert)
	for _, m := range c.Meshes {
		res.AdvertQueueMax = max(res.AdvertQueueMax, m.AdvertQueueLen())
	}
	res.Refusals = c.Refusals()

	stopLoad, loads := changeLoad(c, dilate(opt.LoadEvery))
	defer stopLoad()
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(dilate(opt.Settle)):
	}
	all0, ad0, pp0 := sent()
	bc0 := broadcasts
	start := time.Now()
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(dilate(opt.Window)):
	}
	all1, ad1, pp1 := sent()
	bc1 := broadcasts
	if opt.LoadEvery > 0 {
		stopLoad()
		now := time.Now()
		changed := loads()
		res.LoadChanges = len(changed)
		for i := 1; i < opt.N; i++ {
			held := -1
			for _, cand := range c.Tables[i].Candidates(meshbench.Role) {
				if cand.Node == c.Origin() {
					held = int(cand.Load)
				}
			}
			switch {
			case held < 1 || held > len(changed):
				res.LoadMissing++
			case held < len(changed):
				// Load held stopped being the origin's at change held+1.
				res.LoadStale = max(res.LoadStale, sim(now.Sub(changed[held])))
			}
		}
	}
	res.SteadyPushPulls = pp1 - pp0
	for _, m := range c.Meshes {
		res.AdvertQueueEnd = max(res.AdvertQueueEnd, m.AdvertQueueLen())
	}
	secs := sim(time.Since(start)).Seconds() * float64(opt.N)
	res.BytesPerNodeSec = float64(all1-all0) / secs
	res.AdvertBytesPerNodeSec = float64(ad1-ad0) / secs
	res.AdvertBroadcastBytesPerNodeSec = float64(bc1-bc0) / secs
	return res, nil
}

// changeLoad changes the origin's load every d (0: never) until stop; the
// load is the number of changes so far (what the other nodes should come
// to hold), the capacity a pattern of an engine under traffic. loads is
// when each change was made (the load k+1 at loads()[k]).
func changeLoad(c *meshbench.Cluster, d time.Duration) (stop func(), loads func() []time.Time) {
	var mu sync.Mutex
	var at []time.Time
	if d <= 0 {
		return func() {}, func() []time.Time { return nil }
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			mu.Lock()
			at = append(at, time.Now())
			k := uint32(len(at))
			mu.Unlock()
			c.Tables[0].SetLocalLoad(meshbench.Role, k)
			c.Tables[0].SetLocalCapacity(meshbench.Role, placement.Capacity{Slots: 8, Running: min(k%12, 8), Waiting: k % 12 / 9 * (k % 4),
				KVUsage: float32(k%10) / 10, CacheTokens: 1 << 17, CacheHit: float32(k%7) / 8, HasCacheHit: true})
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-finished }) }, func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), at...)
	}
}

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
