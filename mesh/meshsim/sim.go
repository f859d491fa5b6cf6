package meshsim

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/mesh/meshbench"
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
	// reached everyone. Default 5s.
	Window time.Duration
	// Logf, when set, hears progress.
	Logf func(format string, args ...any)
}

// Result is what a simulation measured.
type Result struct {
	N int
	// Membership is the time from the first join until every node lists
	// every other.
	Membership time.Duration
	// Advert is the time from the origin starting to serve a role until
	// every node resolves it.
	Advert time.Duration
	// AdvertQueueMax is the longest advert broadcast queue of any node
	// when the advert had reached everyone (a starving queue grows).
	AdvertQueueMax int
	// Steady-state bytes sent per node per second over Window: every
	// gossip byte, and the advert part of it (broadcasts and push/pull
	// state); the rest is membership.
	BytesPerNodeSec, AdvertBytesPerNodeSec float64
	// FormBytesPerNode is what each node sent, on average, from the first
	// join until membership was complete.
	FormBytesPerNode float64
	// HeapPerNode is the live heap after membership formed, over N.
	HeapPerNode uint64
	// Net counts lost and overflowed packets over the whole run.
	Net Stats
	// Refusals sums every node's refusal counters.
	Refusals map[string]uint64
}

func (r Result) String() string {
	return fmt.Sprintf("N=%d membership=%v advert=%v advert_queue_max=%d bytes/node/s=%.0f (adverts %.0f, membership %.0f) form_bytes/node=%.0f heap/node=%d KiB lost=%d overflows=%d refusals=%v",
		r.N, r.Membership.Round(time.Millisecond), r.Advert.Round(time.Millisecond), r.AdvertQueueMax,
		r.BytesPerNodeSec, r.AdvertBytesPerNodeSec, r.BytesPerNodeSec-r.AdvertBytesPerNodeSec,
		r.FormBytesPerNode, r.HeapPerNode/1024, r.Net.Lost, r.Net.Overflows, r.Refusals)
}

// Run simulates opt.N nodes over one in-memory Network. A phase that
// fails keeps the figures of the earlier ones.
func Run(ctx context.Context, opt Options) (res Result, err error) {
	res.N = opt.N
	if opt.Window <= 0 {
		opt.Window = 5 * time.Second
	}
	nw := &Network{Latency: opt.Latency, Jitter: opt.Jitter, Loss: opt.Loss}
	ts := make([]*Transport, opt.N)
	heap0 := liveHeap()
	c, err := meshbench.NewCluster(opt.N, opt.Tune, func(i int) memberlist.Transport {
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
	sent := func() (all, adverts uint64) {
		for i, t := range ts {
			all += t.BytesSent()
			s := c.Meshes[i].GossipStats()
			adverts += s.AdvertBroadcastBytes + s.AdvertStateBytes
		}
		return all, adverts
	}

	if res.Membership, err = c.Form(ctx); err != nil {
		return res, err
	}
	formed, _ := sent()
	res.FormBytesPerNode = float64(formed) / float64(opt.N)
	if h := liveHeap(); h > heap0 {
		res.HeapPerNode = (h - heap0) / uint64(opt.N)
	}
	if res.Advert, err = c.Advertise(ctx); err != nil {
		return res, err
	}
	for _, m := range c.Meshes {
		res.AdvertQueueMax = max(res.AdvertQueueMax, m.AdvertQueueLen())
	}
	res.Refusals = c.Refusals()

	all0, ad0 := sent()
	start := time.Now()
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(opt.Window):
	}
	all1, ad1 := sent()
	secs := time.Since(start).Seconds() * float64(opt.N)
	res.BytesPerNodeSec = float64(all1-all0) / secs
	res.AdvertBytesPerNodeSec = float64(ad1-ad0) / secs
	return res, nil
}

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
