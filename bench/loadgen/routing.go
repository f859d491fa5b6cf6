package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// The routing benchmark: where requests go, when where they go matters.
// bench/run.sh starts engines (the demo model in engine mode: slots, a
// queue, a prefix cache) behind a real mesh of agents and describes them in
// a RoutingSpec. For each topology the load generator first measures the
// cluster's capacity, then runs every row (its own routers straight to the
// engines, and infermesh through the consumers' loopback ports) on the
// same seeded workload with open-loop Poisson arrivals at fractions of
// that capacity, and reads the engines' own counters around each run.

// RoutingSpec is what bench/run.sh started for the routing benchmark.
type RoutingSpec struct {
	Engine     EngineSpec        `json:"engine"`
	Topologies []RoutingTopology `json:"topologies"`
}

// EngineSpec is how every engine was started, for the report.
type EngineSpec struct {
	Slots           int    `json:"slots"`
	PrefillPerToken string `json:"prefill_per_token"`
	DecodePerToken  string `json:"decode_per_token"`
	CacheTokens     int    `json:"cache_tokens"`
	CacheBlock      int    `json:"cache_block"`
	// Model is the model the engines know (direct rows ask for it).
	Model string `json:"model"`
	// Scale says how the timings relate to a real server's.
	Scale string `json:"scale,omitempty"`
}

// RoutingTopology is one set of engines and the agents in front of them.
type RoutingTopology struct {
	Name    string          `json:"name"`
	Desc    string          `json:"desc"`
	Engines []RoutingEngine `json:"engines"`
	// Mesh are the infermesh rows: each a set of consumer agents' loopback
	// ports (requests go round robin over them) and the model to ask for.
	Mesh []MeshRow `json:"mesh"`
	// Rates are the fractions of capacity to run at (none: the load
	// generator's -routing-rates).
	Rates []float64 `json:"rates,omitempty"`
}

// RoutingEngine is one engine: the node it serves for and its address.
type RoutingEngine struct {
	Name string `json:"name"`
	Addr string `json:"addr"`
}

// MeshRow is one infermesh row.
type MeshRow struct {
	Name  string   `json:"name"`
	Desc  string   `json:"desc"`
	Addrs []string `json:"addrs"`
	Model string   `json:"model"`
}

// RoutingParams are the phase's durations and rates.
type RoutingParams struct {
	Rates []float64 `json:"rates"`
	// Window is each measured run's arrivals; Warmup the arrivals before
	// it, at WarmupFactor of capacity, drained before the window starts.
	Window       time.Duration `json:"window"`
	Warmup       time.Duration `json:"warmup"`
	WarmupFactor float64       `json:"warmup_factor"`
	// CapWarmup and CapWindow are the capacity measurement's.
	CapWarmup time.Duration `json:"capacity_warmup"`
	CapWindow time.Duration `json:"capacity_window"`
	// Drain bounds the wait for a run's last requests after its window;
	// the ones still unfinished then are cut and counted.
	Drain time.Duration `json:"drain"`
	// SampleEvery is how often the engines' queues are read.
	SampleEvery time.Duration `json:"sample_every"`
	// Best also measures each topology with the best placement (as the
	// capacity, another CapWarmup + CapWindow).
	Best bool `json:"best_placement"`
}

func routingParams(quick bool) RoutingParams {
	if quick {
		return RoutingParams{Rates: []float64{0.5, 1, 1.3}, Window: 2 * time.Second, Warmup: time.Second, WarmupFactor: 0.5,
			CapWarmup: time.Second, CapWindow: 2 * time.Second, Drain: 20 * time.Second, SampleEvery: 100 * time.Millisecond}
	}
	return RoutingParams{Rates: []float64{0.5, 1, 1.3}, Window: 5 * time.Second, Warmup: 1500 * time.Millisecond, WarmupFactor: 0.5,
		CapWarmup: 1500 * time.Millisecond, CapWindow: 4 * time.Second, Drain: 60 * time.Second, SampleEvery: 100 * time.Millisecond, Best: true}
}

// RoutingResults is what the phase measured.
type RoutingResults struct {
	Workload     RoutingWorkload  `json:"workload"`
	WorkloadDesc string           `json:"workload_desc"`
	Engine       EngineSpec       `json:"engine"`
	Params       RoutingParams    `json:"params"`
	Topologies   []TopologyResult `json:"topologies"`
	Phases       []Phase          `json:"phases"`
	// CPUSeconds and WallSeconds are the load generator's own CPU over
	// the phase and the phase's length.
	CPUSeconds  float64 `json:"loadgen_cpu_s"`
	WallSeconds float64 `json:"wall_s"`
}

// TopologyResult is one topology's capacity and runs.
type TopologyResult struct {
	Name    string   `json:"name"`
	Desc    string   `json:"desc"`
	Engines []string `json:"engines"`
	// Capacity is the rates' base: the workload in a closed loop through
	// least outstanding (every slot busy, placement blind to the cache).
	// Best is the same loop with each engine serving its own share of
	// the tenants, every prefix warm: what placement could get at most.
	Capacity CapacityResult `json:"capacity"`
	Best     CapacityResult `json:"best_placement"`
	// Affinity is how many tenants the oracle places on each engine.
	Affinity []int       `json:"oracle_tenants"`
	Runs     []RunResult `json:"runs"`
}

// CapacityResult is a closed-loop measurement: one client per slot.
type CapacityResult struct {
	RPS       float64 `json:"rps"`
	Completed int     `json:"completed"`
	Errors    int     `json:"errors"`
	HitRatio  float64 `json:"hit_ratio"`
	TTFTP50   float64 `json:"ttft_p50_ms"`
	E2EP50    float64 `json:"e2e_p50_ms"`
}

// RunResult is one row at one rate.
type RunResult struct {
	Row    string  `json:"row"`
	Policy string  `json:"policy"`
	Desc   string  `json:"desc"`
	Factor float64 `json:"factor"` // of capacity
	Rate   float64 `json:"rate"`   // requests per second offered
	Sent   int     `json:"sent"`
	OK     int     `json:"ok"`
	// Errors counts the requests that failed, by kind: an HTTP status
	// ("503 with Retry-After"), "connect", "no response", "stream cut",
	// "unfinished" (still running when the drain ended).
	Errors map[string]int `json:"errors,omitempty"`
	// Milliseconds from each request's scheduled arrival.
	TTFT50 float64 `json:"ttft_p50_ms"`
	TTFT90 float64 `json:"ttft_p90_ms"`
	TTFT99 float64 `json:"ttft_p99_ms"`
	E2E50  float64 `json:"e2e_p50_ms"`
	E2E90  float64 `json:"e2e_p90_ms"`
	// TokPerSec is the output tokens received during the window ÷ the
	// window.
	TokPerSec float64 `json:"output_tokens_per_s"`
	// HitRatio is the engines' cached ÷ prompt tokens over the run
	// (their vllm:prefix_cache_hits_total ÷ queries_total).
	HitRatio float64 `json:"hit_ratio"`
	// Share is each engine's part of the requests it finished.
	Share []float64 `json:"share"`
	// QueueFirst and QueueSecond are each engine's longest queue
	// (requests waiting for a slot) in the first and second half of the
	// window; QueueEnd when the window ended.
	QueueFirst  []int `json:"queue_first_half"`
	QueueSecond []int `json:"queue_second_half"`
	QueueEnd    []int `json:"queue_end"`
	// Lateness is how late the load generator sent requests against its
	// Poisson schedule (ms).
	Late50  float64 `json:"late_p50_ms"`
	Late99  float64 `json:"late_p99_ms"`
	LateMax float64 `json:"late_max_ms"`
	// DrainSeconds is how long the last requests took after the window.
	DrainSeconds float64 `json:"drain_s"`
}

// MaxQueue is the longest queue any engine had during the window.
func (r *RunResult) MaxQueue() int {
	m := 0
	for _, q := range append(slices.Clone(r.QueueFirst), r.QueueSecond...) {
		m = max(m, q)
	}
	return m
}

// Failed is the number of failed requests.
func (r *RunResult) Failed() int {
	n := 0
	for _, v := range r.Errors {
		n += v
	}
	return n
}

// routingBench runs the phase.
type routingBench struct {
	spec  RoutingSpec
	p     RoutingParams
	wl    *workload
	ec    *engineClient
	pools sync.Map // addr -> *connPool
}

// runRouting runs the whole phase.
func runRouting(ctx context.Context, spec RoutingSpec, w RoutingWorkload, p RoutingParams) (*RoutingResults, error) {
	if len(spec.Topologies) == 0 {
		return nil, errors.New("routing: no topologies")
	}
	if spec.Engine.Slots < 1 {
		return nil, errors.New("routing: engine slots must be at least 1")
	}
	wl, err := newWorkload(w)
	if err != nil {
		return nil, err
	}
	rb := &routingBench{spec: spec, p: p, wl: wl, ec: newEngineClient()}
	defer rb.ec.close()
	defer rb.closePools()
	res := &RoutingResults{Workload: w, WorkloadDesc: w.Describe(), Engine: spec.Engine, Params: p}
	cpu0, t0 := processCPU(), time.Now()
	for _, topo := range spec.Topologies {
		tr, err := rb.topology(ctx, topo, res)
		if err != nil {
			return nil, fmt.Errorf("routing: %s: %w", topo.Name, err)
		}
		res.Topologies = append(res.Topologies, tr)
	}
	res.CPUSeconds, res.WallSeconds = (processCPU() - cpu0).Seconds(), time.Since(t0).Seconds()
	return res, nil
}

func (rb *routingBench) topology(ctx context.Context, topo RoutingTopology, res *RoutingResults) (TopologyResult, error) {
	tr := TopologyResult{Name: topo.Name, Desc: topo.Desc}
	var addrs []string
	for _, e := range topo.Engines {
		tr.Engines = append(tr.Engines, e.Name)
		addrs = append(addrs, e.Addr)
	}
	if len(addrs) == 0 {
		return tr, errors.New("no engines")
	}
	t := time.Now()
	logf("routing: %s: measuring capacity (%d engines × %d slots, closed loop)", topo.Name, len(addrs), rb.spec.Engine.Slots)
	c, err := rb.capacity(ctx, topo)
	if err != nil {
		return tr, fmt.Errorf("capacity: %w", err)
	}
	tr.Capacity = c
	if rb.p.Best {
		if tr.Best, err = rb.bestPlacement(ctx, topo); err != nil {
			return tr, fmt.Errorf("best placement: %w", err)
		}
	}
	tr.Affinity = make([]int, len(addrs))
	for _, e := range affinity(tr.Engines, rb.wl.w.weights()) {
		tr.Affinity[e]++
	}
	logf("routing: %s: capacity %.1f requests/s (hit ratio %.2f); oracle's tenants per engine %v", topo.Name, c.RPS, c.HitRatio, tr.Affinity)
	if rb.p.Best {
		logf("routing: %s: with the best placement %.1f requests/s (hit ratio %.2f)", topo.Name, tr.Best.RPS, tr.Best.HitRatio)
	}
	res.Phases = append(res.Phases, Phase{Name: "routing " + topo.Name + " capacity", Seconds: time.Since(t).Seconds()})
	if c.RPS <= 0 {
		return tr, errors.New("capacity measured 0 requests per second")
	}
	rows := rb.rows(topo)
	rates := topo.Rates
	if len(rates) == 0 {
		rates = rb.p.Rates
	}
	for _, f := range rates {
		t := time.Now()
		for _, row := range rows {
			if err := ctx.Err(); err != nil {
				return tr, err
			}
			r, err := rb.run(ctx, addrs, row, f, f*c.RPS, c.RPS)
			if err != nil {
				return tr, fmt.Errorf("%s at %.1f×: %w", row.name, f, err)
			}
			logf("  %s %.1f× (%.1f/s): TTFT p50/p90/p99 %.0f/%.0f/%.0f ms, %.0f tok/s, hit %.2f, errors %d, longest queue %d, late p99 %.1f ms",
				row.name, f, r.Rate, r.TTFT50, r.TTFT90, r.TTFT99, r.TokPerSec, r.HitRatio, r.Failed(), r.MaxQueue(), r.Late99)
			tr.Runs = append(tr.Runs, r)
		}
		res.Phases = append(res.Phases, Phase{Name: fmt.Sprintf("routing %s %g×", topo.Name, f), Seconds: time.Since(t).Seconds()})
	}
	return tr, nil
}

// rowSpec is one way of sending the workload.
type rowSpec struct {
	name, desc, policy string
	targets            []target
}

// target is where a row's requests may go.
type target struct {
	name, addr, model string
}

// rows are the topology's rows: the three anchors, then infermesh.
func (rb *routingBench) rows(topo RoutingTopology) []rowSpec {
	var engines []target
	for _, e := range topo.Engines {
		engines = append(engines, target{name: e.Name, addr: e.Addr, model: rb.spec.Engine.Model})
	}
	n := len(engines)
	rows := []rowSpec{
		{"round-robin", fmt.Sprintf("direct, round robin over the %d engines", n), policyRoundRobin, engines},
		{"least-outstanding", fmt.Sprintf("direct, the engine with the fewest requests outstanding (of %d)", n), policyLeast, engines},
		{"oracle", fmt.Sprintf("direct, rendezvous-hash affinity per tenant (bounded by load) over the %d engines; the least loaded when the affine one has > 2 × %d outstanding", n, rb.spec.Engine.Slots), policyOracle, engines},
	}
	for _, m := range topo.Mesh {
		var ts []target
		for i, a := range m.Addrs {
			ts = append(ts, target{name: m.Name + "-" + strconv.Itoa(i), addr: a, model: m.Model})
		}
		rows = append(rows, rowSpec{m.Name, m.Desc, policyMesh, ts})
	}
	return rows
}

// recorder collects one run's requests.
type recorder struct {
	end    time.Time // the end of the window: tokens after it are not counted
	mu     sync.Mutex
	ttft   []time.Duration
	e2e    []time.Duration
	late   []time.Duration
	errs   map[string]int
	ok     int
	tokens atomic.Int64 // received before end
}

func newRecorder(end time.Time) *recorder { return &recorder{end: end, errs: map[string]int{}} }

func (r *recorder) fail(kind string) {
	r.mu.Lock()
	r.errs[kind]++
	r.mu.Unlock()
}

// run runs one row at one rate: the caches emptied, a warm-up at
// WarmupFactor of capacity, drained; the engines' counters read; the
// window; drained; the counters read again.
func (rb *routingBench) run(ctx context.Context, addrs []string, row rowSpec, factor, rate, capRPS float64) (RunResult, error) {
	r := RunResult{Row: row.name, Policy: row.policy, Desc: row.desc, Factor: factor, Rate: rate}
	if err := rb.ec.resetCaches(ctx, addrs); err != nil {
		return r, err
	}
	if _, _, err := rb.open(ctx, row, addrs, rb.p.WarmupFactor*capRPS, rb.p.Warmup, 0, nil, nil); err != nil {
		return r, fmt.Errorf("warm-up: %w", err)
	}
	if err := rb.ec.waitIdle(ctx, addrs, rb.p.Drain); err != nil {
		return r, fmt.Errorf("after the warm-up: %w", err)
	}
	rb.closePools() // every row starts without idle connections
	before, err := rb.ec.readAll(ctx, addrs)
	if err != nil {
		return r, err
	}
	q := newQueueSampler(len(addrs))
	sent, drain, err := rb.open(ctx, row, addrs, rate, rb.p.Window, 1, q, &r)
	if err != nil {
		return r, err
	}
	r.Sent, r.DrainSeconds = sent, drain.Seconds()
	if err := rb.ec.waitIdle(ctx, addrs, rb.p.Drain); err != nil {
		return r, fmt.Errorf("after the window: %w", err)
	}
	after, err := rb.ec.readAll(ctx, addrs)
	if err != nil {
		return r, err
	}
	var queries, hits, reqs float64
	per := make([]float64, len(addrs))
	for i := range addrs {
		queries += after[i].queries - before[i].queries
		hits += after[i].hits - before[i].hits
		per[i] = after[i].requests - before[i].requests
		reqs += per[i]
	}
	if queries > 0 {
		r.HitRatio = hits / queries
	}
	r.Share = make([]float64, len(addrs))
	for i := range per {
		if reqs > 0 {
			r.Share[i] = per[i] / reqs
		}
	}
	r.QueueFirst, r.QueueSecond, r.QueueEnd = q.first, q.second, q.end
	rb.closePools()
	if r.OK == 0 {
		return r, fmt.Errorf("no request succeeded (errors %v)", r.Errors)
	}
	return r, nil
}

// open sends the workload's stream at rate for d (open loop: every
// request at its scheduled time, whatever the ones before it are doing),
// waits for the last ones (at most Drain), and, when out is not nil,
// fills its latency, error and throughput figures; q (when not nil) reads
// the engines' queues meanwhile. It returns the
// requests sent and how long the drain took.
func (rb *routingBench) open(ctx context.Context, row rowSpec, engines []string, rate float64, d time.Duration, stream int, q *queueSampler, out *RunResult) (int, time.Duration, error) {
	times := arrivals(rb.wl.w.Seed, stream, rate, d)
	seq := rb.wl.sequence(stream)
	names := make([]string, len(row.targets))
	for i, t := range row.targets {
		names[i] = t.name
	}
	pk := newPicker(row.policy, names, rb.spec.Engine.Slots, rb.wl.w.weights())
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	rec := newRecorder(start.Add(d))
	if q != nil {
		q.start(runCtx, rb.ec, engines, start, d, rb.p.SampleEvery)
	}
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for _, at := range times {
		it := seq.next()
		due := start.Add(at)
		if wait := time.Until(due); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				wg.Wait()
				return 0, 0, ctx.Err()
			case <-timer.C:
			}
		}
		i := pk.pick(it.tenant)
		tg := row.targets[i]
		wg.Go(func() {
			defer pk.done(i)
			rb.one(runCtx, tg, it, stream, due, rec)
		})
	}
	if wait := time.Until(start.Add(d)); wait > 0 {
		time.Sleep(wait)
	}
	windowEnd := time.Now()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(rb.p.Drain):
		cancel() // the requests still running are cut and counted unfinished
		<-done
	case <-ctx.Done():
		<-done
		return 0, 0, ctx.Err()
	}
	drain := time.Since(windowEnd)
	if q != nil {
		q.stop()
	}
	if out != nil {
		out.OK, out.Errors = rec.ok, rec.errs
		if len(out.Errors) == 0 {
			out.Errors = nil
		}
		ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
		t := quantiles(rec.ttft)
		e := quantiles(rec.e2e)
		l := quantiles(rec.late)
		out.TTFT50, out.TTFT90, out.TTFT99 = ms(t(0.5)), ms(t(0.9)), ms(t(0.99))
		out.E2E50, out.E2E90 = ms(e(0.5)), ms(e(0.9))
		out.Late50, out.Late99, out.LateMax = ms(l(0.5)), ms(l(0.99)), ms(l(1))
		out.TokPerSec = float64(rec.tokens.Load()) / d.Seconds()
	}
	return len(times), drain, nil
}

func engineAddrs(t RoutingTopology) []string {
	var out []string
	for _, e := range t.Engines {
		out = append(out, e.Addr)
	}
	return out
}

// quantiles sorts ds and returns its quantile function (0 when empty).
func quantiles(ds []time.Duration) func(q float64) time.Duration {
	slices.Sort(ds)
	return func(q float64) time.Duration {
		if len(ds) == 0 {
			return 0
		}
		return ds[min(len(ds)-1, int(q*float64(len(ds))))]
	}
}

var (
	contentKey   = []byte(`"content":"`)
	emptyContent = []byte(`"content":""`)
)

// isToken reports whether an event's data carries a generated token.
func isToken(data []byte) bool {
	return bytes.Contains(data, contentKey) && !bytes.Contains(data, emptyContent)
}

// one sends one request and records it.
func (rb *routingBench) one(ctx context.Context, tg target, it item, stream int, due time.Time, rec *recorder) {
	body := rb.wl.body(it, stream, tg.model)
	req := buildRequest(tg.addr, chatPath, body)
	pool := rb.pool(tg.addr)
	c, err := pool.get(ctx)
	if err != nil {
		if ctx.Err() != nil {
			rec.fail("unfinished")
		} else {
			rec.fail("connect")
		}
		return
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	sent := time.Now()
	var first time.Time
	tokens := 0
	h, err := c.streamHead(req, true, func(f frame) {
		if f.done || !isToken(f.data) {
			return
		}
		if tokens == 0 {
			first = f.at
		}
		tokens++
		if f.at.Before(rec.end) {
			rec.tokens.Add(1)
		}
	})
	end := time.Now()
	cut := !stop()
	switch {
	case err == nil && tokens == rb.wl.w.OutputTokens:
		pool.put(c)
		rec.mu.Lock()
		rec.ok++
		rec.ttft = append(rec.ttft, first.Sub(due))
		rec.e2e = append(rec.e2e, end.Sub(due))
		rec.late = append(rec.late, sent.Sub(due))
		rec.mu.Unlock()
		return
	case cut:
		rec.fail("unfinished")
	case h.status == 0:
		rec.fail("no response")
	case h.status != 200 && h.retryAfter:
		rec.fail(strconv.Itoa(h.status) + " with Retry-After")
	case h.status != 200:
		rec.fail(strconv.Itoa(h.status))
	case err != nil:
		rec.fail("stream cut")
	default:
		rec.fail(fmt.Sprintf("%d tokens of %d", tokens, rb.wl.w.OutputTokens))
	}
	rec.mu.Lock()
	rec.late = append(rec.late, sent.Sub(due))
	rec.mu.Unlock()
	c.Close()
}
