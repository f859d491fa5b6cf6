package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// watchdog closes cn when ctx ends or after d, so a hung contender cannot
// hang the harness. The returned stop must be called.
func watchdog(ctx context.Context, cn *conn, d time.Duration) (stop func() bool) {
	wctx, cancel := context.WithTimeout(ctx, d)
	st := context.AfterFunc(wctx, func() { cn.Close() })
	return func() bool { cancel(); return st() }
}

// latencyRep sends small completions one at a time for dur.
func (b *bench) latencyRep(ctx context.Context, ci int, dur time.Duration, record bool) {
	c := b.cs[ci]
	req := buildRequest(c.Fast.Addr, chatPath, smallBody(c.Fast.Model))
	cn, err := dial(ctx, c.Fast.Addr)
	if err != nil {
		b.fail(ci, "c=1 dial: %v", err)
		return
	}
	defer cn.Close()
	defer watchdog(ctx, cn, dur+30*time.Second)()
	for range 20 { // settle the connection (and the proxy's upstream pool)
		if st, err := cn.do(req, nil); err != nil || st != 200 {
			b.fail(ci, "c=1: status %d, err %v", st, err)
			return
		}
	}
	lat := make([]time.Duration, 0, 1<<15)
	start := time.Now()
	deadline := start.Add(dur)
	t0 := start
	for {
		st, err := cn.do(req, nil)
		t1 := time.Now()
		if err != nil || st != 200 {
			b.fail(ci, "c=1: status %d, err %v", st, err)
			return
		}
		lat = append(lat, t1.Sub(t0))
		if t1.After(deadline) {
			break
		}
		t0 = t1
	}
	if record {
		r := b.res[ci]
		r.Lat = append(r.Lat, pcts(lat))
		r.LatRPS = append(r.LatRPS, float64(len(lat))/time.Since(start).Seconds())
	}
}

// throughputRep runs Conc connections sending small completions back to
// back for dur and records requests per second.
func (b *bench) throughputRep(ctx context.Context, ci int, dur time.Duration, record bool) {
	c := b.cs[ci]
	req := buildRequest(c.Fast.Addr, chatPath, smallBody(c.Fast.Model))
	conns := make([]*conn, 0, b.p.Conc)
	defer func() {
		for _, cn := range conns {
			cn.Close()
		}
	}()
	for range b.p.Conc {
		cn, err := dial(ctx, c.Fast.Addr)
		if err != nil {
			b.fail(ci, "c=%d dial: %v", b.p.Conc, err)
			return
		}
		conns = append(conns, cn)
		if st, err := cn.do(req, nil); err != nil || st != 200 {
			b.fail(ci, "c=%d: status %d, err %v", b.p.Conc, st, err)
			return
		}
	}
	var total atomic.Int64
	var wg sync.WaitGroup
	cpu := b.cpuMeter(ci, record)
	start := time.Now()
	deadline := start.Add(dur)
	for _, cn := range conns {
		wg.Go(func() {
			defer watchdog(ctx, cn, dur+30*time.Second)()
			n := int64(0)
			for time.Now().Before(deadline) {
				if st, err := cn.do(req, nil); err != nil || st != 200 {
					b.fail(ci, "c=%d: status %d, err %v", b.p.Conc, st, err)
					break
				}
				n++
			}
			total.Add(n)
		})
	}
	wg.Wait()
	if record {
		r := b.res[ci]
		r.Thr = append(r.Thr, float64(total.Load())/time.Since(start).Seconds())
		if own, up, ok := cpu(total.Load()); ok {
			r.CPU, r.UpCPU = append(r.CPU, own), append(r.UpCPU, up)
		}
	}
}

// cpuMeter reads the CPU the contender's processes (Contender.CPUPIDs)
// and the upstream's (the direct contender's) have used, and returns a
// function that, given the requests completed since, returns the µs of
// each per request. ok is false when either was not read (no pids, a
// process gone, not recording).
func (b *bench) cpuMeter(ci int, record bool) func(requests int64) (own, up float64, ok bool) {
	none := func(int64) (float64, float64, bool) { return 0, 0, false }
	own, upPIDs := b.cs[ci].CPUPIDs, b.cs[0].CPUPIDs
	if !record || len(own) == 0 || len(upPIDs) == 0 {
		return none
	}
	own0, err1 := treeCPU(own)
	up0, err2 := treeCPU(upPIDs)
	if err := errors.Join(err1, err2); err != nil {
		b.cpuOnce.Do(func() { logf("CPU per request not measured: %v", err) })
		return none
	}
	return func(n int64) (float64, float64, bool) {
		own1, err1 := treeCPU(own)
		up1, err2 := treeCPU(upPIDs)
		if errors.Join(err1, err2) != nil || n == 0 {
			return 0, 0, false
		}
		return us(own1-own0) / float64(n), us(up1-up0) / float64(n), true
	}
}

// streamRep runs StreamConc workers, staggered over one stream's length,
// each opening streams one after another for dur, and records the time to
// the first delta and the gaps between deltas (minus the upstream's pacing).
func (b *bench) streamRep(ctx context.Context, ci int, dur time.Duration) {
	c := b.cs[ci]
	req := buildRequest(c.Stream.Addr, chatPath, streamBody(c.Stream.Model))
	var mu sync.Mutex
	var ttft, gaps []time.Duration
	var wg sync.WaitGroup
	streamLen := time.Duration(b.p.StreamTokens) * b.p.StreamDelay
	start := time.Now()
	deadline := start.Add(dur)
	for w := range b.p.StreamConc {
		wg.Go(func() {
			cn, err := dial(ctx, c.Stream.Addr)
			if err != nil {
				b.fail(ci, "stream dial: %v", err)
				return
			}
			defer cn.Close()
			defer watchdog(ctx, cn, dur+streamLen+30*time.Second)()
			time.Sleep(time.Duration(w) * streamLen / time.Duration(b.p.StreamConc))
			var myTTFT, myGaps []time.Duration
			for time.Now().Before(deadline) {
				i := 0
				var prev time.Time
				t0 := time.Now()
				st, err := cn.stream(req, false, func(f frame) {
					switch {
					case i == 0:
						myTTFT = append(myTTFT, f.at.Sub(t0))
					case i < b.p.StreamTokens:
						myGaps = append(myGaps, f.at.Sub(prev)-b.p.StreamDelay)
					}
					prev = f.at
					i++
				})
				if err != nil || st != 200 {
					b.fail(ci, "stream: status %d, err %v", st, err)
					return
				}
				if i != b.p.StreamTokens+2 {
					b.fail(ci, "stream: %d events, want %d", i, b.p.StreamTokens+2)
					return
				}
			}
			mu.Lock()
			ttft = append(ttft, myTTFT...)
			gaps = append(gaps, myGaps...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(ttft) > 0 {
		b.res[ci].TTFT = append(b.res[ci].TTFT, pcts(ttft))
		b.res[ci].Gap = append(b.res[ci].Gap, pcts(gaps))
	}
}
