package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/mesh/meshbench"
	"github.com/infermesh/infermesh/mesh/meshsim"
)

// meshProfile tunes the mesh for the convergence measurement; nil runs
// mesh.DefaultConfig, what a deployment runs.
var (
	meshProfile     func(*mesh.Config)
	meshProfileName = "default (LAN)"
)

const chatPath = "/v1/chat/completions"

// smallBody is a small non-streaming chat completion (what an SDK sends for
// a short prompt); streamBody asks for the upstream's whole stream.
func smallBody(model string) []byte {
	return []byte(`{"model":` + strconv.Quote(model) + `,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say hello in five words."}],"max_tokens":16,"temperature":0}`)
}

func streamBody(model string) []byte {
	return []byte(`{"model":` + strconv.Quote(model) + `,"stream":true,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Tell me a story."}],"temperature":0}`)
}

// latRep is one repetition's latency figures.
type latRep struct {
	P50, P99 time.Duration
	N        int
}

// manyRes is one concurrent-streams run.
type manyRes struct {
	Streams       int     `json:"streams"`
	Completed     int     `json:"completed"`
	PeakOpen      int     `json:"peak_open"`
	SlowStarts    int     `json:"slow_starts"`
	StalledFrames int     `json:"stalled_frames"`
	DroppedFrames int     `json:"dropped_frames"`
	Failed        int     `json:"failed_streams"`
	RSSBeforeKiB  int64   `json:"rss_before_kib"`
	RSSPeakKiB    int64   `json:"rss_peak_kib"` // the peak of the sum over the processes
	KiBPerStream  float64 `json:"kib_per_stream"`
	Duration      string  `json:"duration"`
	// RSSParts splits RSS by process when more than one is sampled.
	RSSParts []rssPart `json:"rss_parts,omitempty"`
}

// rssPart is one sampled process's RSS before a level and its own peak.
type rssPart struct {
	PID       int    `json:"pid"`
	Name      string `json:"name,omitempty"`
	BeforeKiB int64  `json:"before_kib"`
	PeakKiB   int64  `json:"peak_kib"`
}

// contRes holds every repetition of every workload of one contender.
type contRes struct {
	Lat     []latRep
	LatRPS  []float64
	Thr     []float64
	CPU     []float64 // µs of the contender's CPU per request, per c=64 repetition
	UpCPU   []float64 // µs of the upstream's CPU per request, likewise
	TTFT    []latRep
	Gap     []latRep // inter-delta gap minus the pacing delay
	Many    []manyRes
	Errors  int
	ErrList []string
}

type bench struct {
	cs        []Contender
	p         Params
	res       []*contRes
	mu        sync.Mutex // guards res[*].Errors and ErrList
	started   time.Time
	mesh      []meshRes
	sim       []simRes
	h3        []latRep // the bare HTTP/3 exchange at c=1, per repetition
	h3Err     string   // why h3 is missing or cut short ("" when measured or not wanted)
	cpuOnce   sync.Once
	phases    []Phase // how long each part of the run took, in order
	loadStart string  // the load average when the load generator started
}

// phase records that the part of the run called name, begun at start, is
// over, and logs how long it took.
func (b *bench) phase(name string, start time.Time) {
	d := time.Since(start)
	b.phases = append(b.phases, Phase{Name: name, Seconds: d.Seconds()})
	logf("phase %s took %v", name, d.Round(time.Second))
}

// simRes is one in-memory mesh simulation (mesh/meshsim).
type simRes struct {
	N                int     `json:"n"`
	Membership       string  `json:"membership,omitempty"`
	Advert           string  `json:"advert,omitempty"`
	TimeScale        float64 `json:"time_scale"`
	AdvertQueueMax   int     `json:"advert_queue_max"`
	AdvertQueueEnd   int     `json:"advert_queue_end"`
	FormPushPulls    uint64  `json:"form_push_pulls"`
	SteadyPushPulls  uint64  `json:"steady_push_pulls"`
	BytesPerNodeSec  float64 `json:"bytes_per_node_s"`
	AdvertBytesNodeS float64 `json:"advert_bytes_per_node_s"`
	// LoadChanges is how often the origin's load changed in the window
	// (once a simulated second); LoadStale how far behind (simulated) the
	// stalest node's was at the end; LoadMissing how many held none.
	LoadChanges      int     `json:"load_changes"`
	LoadStale        string  `json:"load_stale,omitempty"`
	LoadMissing      int     `json:"load_missing"`
	FormBytesPerNode float64 `json:"form_bytes_per_node"`
	HeapPerNodeKiB   uint64  `json:"heap_per_node_kib"`
	CPUSeconds       float64 `json:"cpu_s"`
	WallSeconds      float64 `json:"wall_s"`
	Overflows        uint64  `json:"overflows"`
	Err              string  `json:"error,omitempty"`
}

type meshRes struct {
	N          int    `json:"n"`
	Membership string `json:"membership,omitempty"`
	Advert     string `json:"advert,omitempty"`
	Death      string `json:"death,omitempty"`
	Err        string `json:"error,omitempty"`
	Profile    string `json:"profile"`
}

func newBench(cs []Contender, p Params) *bench {
	b := &bench{cs: cs, p: p, started: time.Now(), loadStart: loadAvg()}
	for range cs {
		b.res = append(b.res, &contRes{})
	}
	return b
}

func (b *bench) fail(ci int, format string, args ...any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.res[ci]
	r.Errors++
	if len(r.ErrList) < 10 {
		r.ErrList = append(r.ErrList, fmt.Sprintf(format, args...))
	}
}

// live returns the indexes of the measured contenders.
func (b *bench) live() []int {
	var out []int
	for i, c := range b.cs {
		if c.Missing == "" {
			out = append(out, i)
		}
	}
	return out
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

// check sends one request of each kind to every contender and verifies the
// answers: status 200, the model the client asked for echoed back, the
// whole stream with [DONE].
func (b *bench) check(ctx context.Context) error {
	live := b.live()
	errs := make([]error, len(live))
	var wg sync.WaitGroup
	for i, ci := range live {
		wg.Go(func() { errs[i] = b.checkOne(ctx, b.cs[ci]) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (b *bench) checkOne(ctx context.Context, c Contender) error {
	{
		cn, err := dial(ctx, c.Fast.Addr)
		if err != nil {
			return fmt.Errorf("%s: %w", c.Name, err)
		}
		var body []byte
		st, err := cn.do(buildRequest(c.Fast.Addr, chatPath, smallBody(c.Fast.Model)), &body)
		cn.Close()
		if err != nil || st != 200 {
			return fmt.Errorf("%s: check request: status %d, err %v, body %q", c.Name, st, err, body)
		}
		if want := `"model":` + strconv.Quote(c.Fast.Model); !bytes.Contains(body, []byte(want)) {
			return fmt.Errorf("%s: check request: response %q lacks %s", c.Name, body, want)
		}
		for _, t := range []struct {
			tg     Target
			tokens int
		}{{c.Stream, b.p.StreamTokens}, {c.Many, b.p.ManyTokens}} {
			cn, err := dial(ctx, t.tg.Addr)
			if err != nil {
				return fmt.Errorf("%s: %w", c.Name, err)
			}
			var frames []frame
			st, err = cn.stream(buildRequest(t.tg.Addr, chatPath, streamBody(t.tg.Model)), true, func(f frame) { frames = append(frames, f) })
			cn.Close()
			if err != nil || st != 200 {
				return fmt.Errorf("%s: check stream on %s: status %d, err %v", c.Name, t.tg.Addr, st, err)
			}
			// tokens deltas, the finish chunk, [DONE]
			if len(frames) != t.tokens+2 {
				return fmt.Errorf("%s: check stream on %s: %d data events, want %d (is the upstream's -tokens %d?)", c.Name, t.tg.Addr, len(frames), t.tokens+2, t.tokens)
			}
			want := []byte(`"model":` + strconv.Quote(t.tg.Model))
			for _, f := range frames[:len(frames)-1] {
				if !bytes.Contains(f.data, want) {
					return fmt.Errorf("%s: check stream: event %q lacks %s", c.Name, f.data, want)
				}
			}
		}
	}
	return nil
}

func (b *bench) runAll(ctx context.Context) {
	live := b.live()
	logf("warm-up: %v per contender", b.p.Warmup)
	t := time.Now()
	for _, ci := range live {
		b.throughputRep(ctx, ci, b.p.Warmup, false)
		b.latencyRep(ctx, ci, b.p.Warmup/2, false)
	}
	h3 := b.startH3(ctx)
	b.phase("warm-up", t)
	t = time.Now()
	logf("c=1 latency and c=%d throughput: %d interleaved repetitions", b.p.Conc, b.p.Reps)
	for rep := 0; rep < b.p.Reps && ctx.Err() == nil; rep++ {
		for _, ci := range live {
			b.latencyRep(ctx, ci, b.p.LatencyDur, true)
		}
		if h3 != nil {
			if err := b.h3LatencyRep(ctx, h3, b.p.LatencyDur, true); err != nil {
				b.h3Err = fmt.Sprintf("bare HTTP/3 exchange failed: %v", err)
				h3.Close()
				h3 = nil
			}
		}
		for _, ci := range live {
			b.throughputRep(ctx, ci, b.p.ThroughDur, true)
		}
	}
	if h3 != nil {
		h3.Close()
	}
	b.phase(fmt.Sprintf("c=1 and c=%d", b.p.Conc), t)
	t = time.Now()
	logf("streaming: %d interleaved repetitions of %d concurrent streams, %d deltas %v apart", b.p.StreamReps, b.p.StreamConc, b.p.StreamTokens, b.p.StreamDelay)
	for rep := 0; rep < b.p.StreamReps && ctx.Err() == nil; rep++ {
		for _, ci := range live {
			b.streamRep(ctx, ci, b.p.StreamDur)
		}
	}
	b.phase("streaming", t)
	for _, n := range b.p.ManyLevels {
		t = time.Now()
		for _, ci := range live {
			if ctx.Err() != nil {
				return
			}
			logf("concurrent streams: %s, %d streams", b.cs[ci].Name, n)
			r := b.manyRun(ctx, ci, n)
			b.res[ci].Many = append(b.res[ci].Many, r)
			logf("  completed %d/%d, peak open %d, slow starts %d, stalled frames %d, dropped frames %d, rss %d -> %d KiB", r.Completed, r.Streams, r.PeakOpen, r.SlowStarts, r.StalledFrames, r.DroppedFrames, r.RSSBeforeKiB, r.RSSPeakKiB)
		}
		b.phase(fmt.Sprintf("%d streams", n), t)
	}
	for _, n := range b.p.MeshNodes {
		if ctx.Err() != nil {
			return
		}
		logf("mesh: advert convergence, %d in-process nodes", n)
		t = time.Now()
		mctx, cancel := context.WithTimeout(ctx, b.p.MeshTimeout)
		r, err := meshbench.Measure(mctx, n, meshProfile)
		cancel()
		mr := meshRes{N: n, Profile: meshProfileName}
		if err != nil {
			mr.Err = err.Error()
		}
		// A failure in a later phase keeps the figures of the earlier ones.
		for _, f := range []struct {
			d   time.Duration
			out *string
		}{{r.Membership, &mr.Membership}, {r.Advert, &mr.Advert}, {r.Death, &mr.Death}} {
			if f.d > 0 {
				*f.out = f.d.Round(time.Millisecond).String()
			}
		}
		logf("  %+v", mr)
		b.mesh = append(b.mesh, mr)
		b.phase(fmt.Sprintf("mesh N=%d", n), t)
	}
	for _, n := range b.p.SimNodes {
		if ctx.Err() != nil {
			return
		}
		logf("mesh simulation: %d nodes over an in-memory network (%v latency, time x%g)", n, simLatency, meshsim.TimeScaleFor(n))
		t = time.Now()
		b.sim = append(b.sim, runSim(ctx, n, b.p.SimTimeout))
		logf("  %+v", b.sim[len(b.sim)-1])
		b.phase(fmt.Sprintf("sim N=%d", n), t)
	}
}

// simLatency is the one-way latency of the simulated network (a LAN).
const simLatency = time.Millisecond

// simWindow is how long the simulation's traffic is measured, in
// simulated time: long enough to hold the origin's load adverts, which
// the gossip budget spaces about 12 s apart at N=1000.
const simWindow = 30 * time.Second

// runSim runs one mesh simulation and records the process CPU it took
// (the simulation shares the host's cores: a run whose CPU is near cores x
// wall was starved, and its figures are the host's, not the protocol's).
func runSim(ctx context.Context, n int, timeout time.Duration) simRes {
	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cpu0, t0 := processCPU(), time.Now()
	r, err := meshsim.Run(sctx, meshsim.Options{N: n, Latency: simLatency, Window: simWindow, TimeScale: meshsim.TimeScaleFor(n), LoadEvery: time.Second})
	sr := simRes{N: n, TimeScale: r.TimeScale, AdvertQueueMax: r.AdvertQueueMax, AdvertQueueEnd: r.AdvertQueueEnd,
		FormPushPulls: r.FormPushPulls, SteadyPushPulls: r.SteadyPushPulls, BytesPerNodeSec: r.BytesPerNodeSec,
		AdvertBytesNodeS: r.AdvertBytesPerNodeSec, FormBytesPerNode: r.FormBytesPerNode, LoadChanges: r.LoadChanges, LoadStale: r.LoadStale.Round(time.Millisecond).String(), LoadMissing: r.LoadMissing,
		HeapPerNodeKiB: r.HeapPerNode / 1024, Overflows: r.Net.Overflows,
		CPUSeconds: (processCPU() - cpu0).Seconds(), WallSeconds: time.Since(t0).Seconds()}
	if err != nil {
		sr.Err = err.Error()
	}
	if r.Membership > 0 {
		sr.Membership = r.Membership.Round(time.Millisecond).String()
	}
	if r.Advert > 0 {
		sr.Advert = r.Advert.Round(time.Millisecond).String()
	}
	return sr
}

// processCPU is the user+system CPU this process used so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// startH3 starts and warms the bare HTTP/3 exchange when a remote-path
// contender (infermesh-quic) is measured; nil otherwise or on failure
// (recorded in h3Err).
func (b *bench) startH3(ctx context.Context) *meshbench.BareH3 {
	if !b.p.BareH3 || !slices.ContainsFunc(b.live(), func(ci int) bool { return b.cs[ci].Name == quicName }) {
		return nil
	}
	h, err := meshbench.NewBareH3()
	if err != nil {
		b.h3Err = err.Error()
		return nil
	}
	if err := b.h3LatencyRep(ctx, h, b.p.Warmup/2, false); err != nil {
		b.h3Err = fmt.Sprintf("bare HTTP/3 exchange failed: %v", err)
		h.Close()
		return nil
	}
	return h
}

// manyRun opens n streams, each on its own connection, at ManyRate per
// second, keeps them all open (each lasts ManyTokens*ManyDelay), and
// counts stalled frames (a gap over StallAfter), dropped frames (missing
// from a stream that ended early) and failed streams, while sampling the
// contender's RSS.
func (b *bench) manyRun(ctx context.Context, ci, n int) manyRes {
	c := b.cs[ci]
	req := buildRequest(c.Many.Addr, chatPath, streamBody(c.Many.Model))
	want := b.p.ManyTokens + 1 // deltas and the finish chunk, before [DONE]
	res := manyRes{Streams: n}
	pids := c.pids()
	parts := make([]rssPart, len(pids))
	// sampleRSS reads every process, keeps each one's peak and returns the sum.
	sampleRSS := func(first bool) int64 {
		var sum int64
		for i, pid := range pids {
			v := readRSS(pid)
			sum += v
			if first {
				parts[i] = rssPart{PID: pid, BeforeKiB: v, PeakKiB: v}
				if i < len(c.PIDNames) && len(c.PIDs) == len(pids) {
					parts[i].Name = c.PIDNames[i]
				}
			} else if v > parts[i].PeakKiB {
				parts[i].PeakKiB = v
			}
		}
		return sum
	}
	res.RSSBeforeKiB = sampleRSS(true)
	streamLen := time.Duration(b.p.ManyTokens) * b.p.ManyDelay

	var open, peak, completed, slow, stalled, dropped, failed atomic.Int64
	var firstErr sync.Once
	sampleDone := make(chan struct{})
	var sampler sync.WaitGroup
	var rssPeak atomic.Int64
	rssPeak.Store(res.RSSBeforeKiB)
	sampler.Go(func() {
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-sampleDone:
				return
			case <-t.C:
				if v := sampleRSS(false); v > rssPeak.Load() {
					rssPeak.Store(v)
				}
			}
		}
	})

	var wg sync.WaitGroup
	start := time.Now()
	for k := range n {
		// Pace the opening: k streams are due at k/rate seconds.
		if due := start.Add(time.Duration(k) * time.Second / time.Duration(b.p.ManyRate)); time.Until(due) > time.Millisecond {
			time.Sleep(time.Until(due))
		}
		wg.Go(func() {
			streamErr := func(format string, args ...any) {
				failed.Add(1)
				firstErr.Do(func() { b.fail(ci, "%d streams: "+format, append([]any{n}, args...)...) })
			}
			cn, err := dial(ctx, c.Many.Addr)
			if err != nil {
				streamErr("dial: %v", err)
				dropped.Add(int64(want))
				return
			}
			defer cn.Close()
			defer watchdog(ctx, cn, 4*streamLen+60*time.Second)()
			got := 0
			isOpen := false
			prev := time.Now()
			st, err := cn.stream(req, false, func(f frame) {
				if f.at.Sub(prev) > b.p.StallAfter {
					if got == 0 {
						slow.Add(1) // the first delta: opening the stream was slow
					} else {
						stalled.Add(1)
					}
				}
				prev = f.at
				if f.done {
					return
				}
				got++
				if !isOpen {
					isOpen = true
					if o := open.Add(1); o > peak.Load() {
						peak.Store(o) // racy max; only ever low by a hair
					}
				}
			})
			if isOpen {
				open.Add(-1)
			}
			if got < want {
				dropped.Add(int64(want - got))
			}
			if err != nil || st != 200 {
				streamErr("status %d, err %v", st, err)
				return
			}
			completed.Add(1)
		})
	}
	wg.Wait()
	close(sampleDone)
	sampler.Wait()
	res.Duration = time.Since(start).Round(time.Millisecond).String()
	res.Completed, res.PeakOpen = int(completed.Load()), int(peak.Load())
	res.SlowStarts, res.StalledFrames = int(slow.Load()), int(stalled.Load())
	res.DroppedFrames, res.Failed = int(dropped.Load()), int(failed.Load())
	res.RSSPeakKiB = rssPeak.Load()
	if len(pids) > 1 {
		res.RSSParts = parts
	}
	if len(pids) > 0 && res.RSSBeforeKiB > 0 {
		res.KiBPerStream = float64(res.RSSPeakKiB-res.RSSBeforeKiB) / float64(n)
	}
	return res
}

// readRSS returns VmRSS of pid in KiB (0 when unknown).
func readRSS(pid int) int64 {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}

// pcts returns the p50 and p99 of ds (sorted in place).
func pcts(ds []time.Duration) latRep {
	if len(ds) == 0 {
		return latRep{}
	}
	slices.Sort(ds)
	at := func(q float64) time.Duration { return ds[min(len(ds)-1, int(q*float64(len(ds))))] }
	return latRep{P50: at(0.50), P99: at(0.99), N: len(ds)}
}
