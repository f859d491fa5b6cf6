package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// closedLoop runs one client per slot of the topology's engines for the
// capacity measurements: each sends a request, waits for its answer and
// sends the next. next gives a client its next request and target (it is
// called under a lock) and done is told when it is answered. It counts
// the requests answered between CapWarmup and CapWarmup + CapWindow and
// reads the engines' counters around that window.
func (rb *routingBench) closedLoop(ctx context.Context, topo RoutingTopology, next func(client int) (item, int), done func(engine int)) (CapacityResult, error) {
	var res CapacityResult
	addrs := engineAddrs(topo)
	if err := rb.ec.resetCaches(ctx, addrs); err != nil {
		return res, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	from, to := start.Add(rb.p.CapWarmup), start.Add(rb.p.CapWarmup+rb.p.CapWindow)
	var before []engineReading
	var beforeErr error
	var once sync.Once
	var mu sync.Mutex // guards next, res and the figures
	var ttft, e2e []time.Duration
	var wg sync.WaitGroup
	for cl := range len(addrs) * rb.spec.Engine.Slots {
		wg.Go(func() {
			rec := newRecorder(to)
			for time.Now().Before(to) && runCtx.Err() == nil {
				if !time.Now().Before(from) {
					once.Do(func() { before, beforeErr = rb.ec.readAll(ctx, addrs) })
				}
				mu.Lock()
				it, e := next(cl)
				mu.Unlock()
				tg := target{name: topo.Engines[e].Name, addr: addrs[e], model: rb.spec.Engine.Model}
				t0 := time.Now()
				ok0 := len(rec.ttft)
				rb.one(runCtx, tg, it, capacityStream, t0, rec)
				mu.Lock()
				done(e)
				if len(rec.ttft) > ok0 && !t0.Before(from) && !time.Now().After(to) {
					res.Completed++
					ttft = append(ttft, rec.ttft[ok0])
					e2e = append(e2e, rec.e2e[ok0])
				}
				mu.Unlock()
			}
			n := rec.Failed()
			mu.Lock()
			res.Errors += n
			mu.Unlock()
		})
	}
	wg.Wait()
	rb.closePools()
	if beforeErr != nil {
		return res, beforeErr
	}
	if err := rb.ec.waitIdle(ctx, addrs, rb.p.Drain); err != nil {
		return res, err
	}
	after, err := rb.ec.readAll(ctx, addrs)
	if err != nil {
		return res, err
	}
	var q, h float64
	for i := range addrs {
		if before != nil {
			q += after[i].queries - before[i].queries
			h += after[i].hits - before[i].hits
		}
	}
	if q > 0 {
		res.HitRatio = h / q
	}
	res.RPS = float64(res.Completed) / rb.p.CapWindow.Seconds()
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	res.TTFTP50, res.E2EP50 = ms(quantiles(ttft)(0.5)), ms(quantiles(e2e)(0.5))
	return res, nil
}

// capacityStream is the workload stream of the capacity measurements.
const capacityStream = 100

// capacity measures the topology's capacity: the workload's requests in a
// closed loop, one client per slot, each to the engine with the fewest
// requests outstanding (every slot busy, the placement blind to the
// cache: what a plain load balancer gets out of the engines).
func (rb *routingBench) capacity(ctx context.Context, topo RoutingTopology) (CapacityResult, error) {
	names := make([]string, len(topo.Engines))
	for i, e := range topo.Engines {
		names[i] = e.Name
	}
	pk := newPicker(policyLeast, names, rb.spec.Engine.Slots, nil)
	seq := rb.wl.sequence(capacityStream)
	return rb.closedLoop(ctx, topo, func(int) (item, int) {
		it := seq.next()
		return it, pk.pick(it.tenant)
	}, pk.done)
}

// bestPlacement measures what the engines do with the best placement:
// the same closed loop, each engine serving its own equal share of the
// tenants (tenant t on engine t mod n), every prefix warm.
func (rb *routingBench) bestPlacement(ctx context.Context, topo RoutingTopology) (CapacityResult, error) {
	n := len(topo.Engines)
	share := make([][]int, n)
	for t := range rb.wl.w.Tenants {
		share[t%n] = append(share[t%n], t)
	}
	for e := range share {
		if len(share[e]) == 0 { // more engines than tenants
			share[e] = append(share[e], e%rb.wl.w.Tenants)
		}
	}
	sent := make([]int, n*rb.spec.Engine.Slots)
	q := 0
	return rb.closedLoop(ctx, topo, func(cl int) (item, int) {
		e := cl % n
		k := sent[cl]
		sent[cl]++
		q++
		return item{tenant: share[e][(cl/n+k)%len(share[e])], turns: []int{1<<30 + q}}, e
	}, func(int) {})
}

// Failed is the recorder's failed requests.
func (r *recorder) Failed() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, v := range r.errs {
		n += v
	}
	return n
}

// checkRoutingSpec checks that every engine and consumer accepts
// connections before the phase starts.
func checkRoutingSpec(spec RoutingSpec) error {
	var errs []error
	check := func(what, addr string) {
		if c, err := net.DialTimeout("tcp", addr, 2*time.Second); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
		} else {
			c.Close()
		}
	}
	for _, t := range spec.Topologies {
		for _, e := range t.Engines {
			check(t.Name+": engine "+e.Name, e.Addr)
		}
		for _, m := range t.Mesh {
			for _, a := range m.Addrs {
				check(t.Name+": "+m.Name, a)
			}
		}
	}
	return errors.Join(errs...)
}
