package main

import (
	"fmt"
	"maps"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/infermesh/infermesh/mesh"
)

// Stat is a figure over repetitions: the median and the spread.
type Stat struct {
	Med float64 `json:"median"`
	Min float64 `json:"min"`
	Max float64 `json:"max"`
	N   int     `json:"reps"`
}

func stat(xs []float64) *Stat {
	if len(xs) == 0 {
		return nil
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return &Stat{Med: m, Min: s[0], Max: s[len(s)-1], N: len(s)}
}

// LatFig is a latency workload's figures in microseconds. Added figures
// are the contender's minus the direct path's, per repetition.
type LatFig struct {
	P50       *Stat `json:"p50_us"`
	P99       *Stat `json:"p99_us"`
	AddedP50  *Stat `json:"added_p50_us,omitempty"`
	AddedP99  *Stat `json:"added_p99_us,omitempty"`
	P99Direct *Stat `json:"p99_ratio_to_direct,omitempty"`
	// AddedP99Nginx is this contender's median added p99 over nginx's.
	AddedP50Nginx float64 `json:"added_p50_ratio_to_nginx,omitempty"`
	AddedP99Nginx float64 `json:"added_p99_ratio_to_nginx,omitempty"`
	RPS           *Stat   `json:"rps,omitempty"`
}

// ThrFig is the throughput workload's figures.
type ThrFig struct {
	RPS    *Stat `json:"rps"`
	Direct *Stat `json:"ratio_to_direct,omitempty"`
	Nginx  *Stat `json:"ratio_to_nginx,omitempty"`
	// CPU is the µs of CPU (user + system) the contender's processes used
	// per request completed; UpstreamCPU the upstream's, over the same
	// repetitions (for direct they are the same processes).
	CPU         *Stat `json:"cpu_us_per_request,omitempty"`
	UpstreamCPU *Stat `json:"upstream_cpu_us_per_request,omitempty"`
}

// ContReport is one contender's results.
type ContReport struct {
	Name         string    `json:"name"`
	Desc         string    `json:"desc"`
	Missing      string    `json:"missing,omitempty"`
	Errors       int       `json:"errors"`
	ErrorSamples []string  `json:"error_samples,omitempty"`
	C1           *LatFig   `json:"c1,omitempty"`
	Throughput   *ThrFig   `json:"throughput,omitempty"`
	TTFT         *LatFig   `json:"stream_ttft,omitempty"`
	Gap          *LatFig   `json:"stream_gap_minus_delay,omitempty"`
	Many         []manyRes `json:"concurrent_streams,omitempty"`
}

// Report is what a run found.
type Report struct {
	Started    time.Time         `json:"started"`
	Elapsed    string            `json:"elapsed"`
	Mode       string            `json:"mode"`
	Cores      int               `json:"cores"`
	CPU        string            `json:"cpu"`
	GoVersion  string            `json:"go_version"`
	Meta       map[string]string `json:"meta,omitempty"`
	Params     Params            `json:"params"`
	Contenders []ContReport      `json:"contenders"`
	Mesh       []meshRes         `json:"mesh,omitempty"`
	Sim        []simRes          `json:"sim,omitempty"`
	// Instructions are the instruction counts of each proxy's processes
	// for a fixed number of requests (bench/run.sh, callgrind).
	Instructions []instrCount `json:"instructions,omitempty"`
	// BareH3 is a bare HTTP/3 exchange at c=1 (two mesh transports in the
	// load generator's process), measured with infermesh-quic; BareH3Note
	// says why it is missing.
	BareH3     *LatFig `json:"bare_h3_c1,omitempty"`
	BareH3Note string  `json:"bare_h3_note,omitempty"`
	// Routing is the routing benchmark's results (bench/run.sh runs it
	// apart, before the contenders start).
	Routing *RoutingResults `json:"routing,omitempty"`
	Targets []TargetCheck   `json:"targets"`
	// Phases are the parts of the whole run (bench/run.sh's, then the
	// load generator's) and how long each took; Total is from bench/run.sh's
	// start (the load generator's when it ran alone) to the report.
	Phases []Phase `json:"phases"`
	Total  string  `json:"total"`
	// LoadStart and LoadEnd are /proc/loadavg's 1, 5 and 15 minute load
	// averages when the run started and when it ended.
	LoadStart string `json:"loadavg_start,omitempty"`
	LoadEnd   string `json:"loadavg_end,omitempty"`
}

// Phase is one part of the run and how long it took.
type Phase struct {
	Name    string  `json:"name"`
	Seconds float64 `json:"seconds"`
}

// Harness is what bench/run.sh tells the load generator about the run
// before it (-harness): when it started, the load average then, and its
// phases (the instruction counts, the contenders' start).
type Harness struct {
	Started   int64   `json:"started"` // Unix seconds
	LoadStart string  `json:"loadavg_start"`
	Phases    []Phase `json:"phases"`
}

// loadAvg is the 1, 5 and 15 minute load averages ("" when unknown).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func fmtSeconds(s float64) string {
	return (time.Duration(s * float64(time.Second))).Round(time.Second).String()
}

// TargetCheck is one of the targets, reported (never asserted):
// this run's figure, the goal, and "yes", "**no**", "n/a" (not measured)
// or "–" (a figure without a goal).
type TargetCheck struct {
	Target string `json:"target"`
	Figure string `json:"figure"`
	Goal   string `json:"goal"`
	Met    string `json:"met"`
}

// Errors is the number of errors any contender returned.
func (r *Report) Errors() int {
	n := 0
	for _, c := range r.Contenders {
		n += c.Errors
	}
	return n
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// perRep maps f over the repetitions both x and base have.
func perRep(x, base []latRep, f func(x, base latRep) float64) []float64 {
	n := min(len(x), len(base))
	out := make([]float64, n)
	for i := range n {
		out[i] = f(x[i], base[i])
	}
	return out
}

func latFig(x, direct, nginx []latRep, isDirect bool) *LatFig {
	if len(x) == 0 {
		return nil
	}
	f := &LatFig{
		P50: stat(perRep(x, x, func(a, _ latRep) float64 { return us(a.P50) })),
		P99: stat(perRep(x, x, func(a, _ latRep) float64 { return us(a.P99) })),
	}
	if isDirect {
		return f
	}
	f.AddedP50 = stat(perRep(x, direct, func(a, d latRep) float64 { return us(a.P50 - d.P50) }))
	f.AddedP99 = stat(perRep(x, direct, func(a, d latRep) float64 { return us(a.P99 - d.P99) }))
	f.P99Direct = stat(perRep(x, direct, func(a, d latRep) float64 { return float64(a.P99) / float64(d.P99) }))
	if len(nginx) > 0 {
		n50 := stat(perRep(nginx, direct, func(a, d latRep) float64 { return us(a.P50 - d.P50) }))
		n99 := stat(perRep(nginx, direct, func(a, d latRep) float64 { return us(a.P99 - d.P99) }))
		if n50 != nil && n50.Med > 0 {
			f.AddedP50Nginx = f.AddedP50.Med / n50.Med
		}
		if n99 != nil && n99.Med > 0 {
			f.AddedP99Nginx = f.AddedP99.Med / n99.Med
		}
	}
	return f
}

func ratios(x, base []float64) []float64 {
	n := min(len(x), len(base))
	out := make([]float64, n)
	for i := range n {
		out[i] = x[i] / base[i]
	}
	return out
}

// routingReport is the report of a routing phase run alone (mode
// quick-routing or full-routing).
func routingReport(started time.Time, quick bool, meta map[string]string, h Harness, rr *RoutingResults) *Report {
	mode := "full-routing"
	if quick {
		mode = "quick-routing"
	}
	r := &Report{
		Started: started, Elapsed: time.Since(started).Round(time.Second).String(), Mode: mode,
		Cores: runtime.NumCPU(), CPU: cpuModel(), GoVersion: runtime.Version(), Meta: meta,
		Phases: slices.Clone(h.Phases), LoadStart: h.LoadStart, LoadEnd: loadAvg(), Routing: rr,
	}
	if h.Started > 0 {
		started = time.Unix(h.Started, 0)
	}
	r.Total = time.Since(started).Round(time.Second).String()
	r.Targets = r.summary()
	return r
}

func (b *bench) report(meta map[string]string, h Harness, instr []instrCount, routing *RoutingResults) *Report {
	mode := "full"
	if b.p.Quick {
		mode = "quick"
	}
	r := &Report{
		Started: b.started, Elapsed: time.Since(b.started).Round(time.Second).String(), Mode: mode,
		Cores: runtime.NumCPU(), CPU: cpuModel(), GoVersion: runtime.Version(), Meta: meta, Params: b.p, Mesh: b.mesh, Sim: b.sim,
		Instructions: instr, Phases: append(slices.Clone(h.Phases), b.phases...), LoadStart: h.LoadStart, LoadEnd: loadAvg(),
		Routing: routing,
	}
	started := b.started
	if h.Started > 0 {
		started = time.Unix(h.Started, 0)
	}
	r.Total = time.Since(started).Round(time.Second).String()
	if r.LoadStart == "" {
		r.LoadStart = b.loadStart
	}
	r.BareH3 = latFig(b.h3, nil, nil, true)
	r.BareH3Note = b.h3Err
	direct := b.res[0]
	nginxIdx := -1
	for i, c := range b.cs {
		if c.Name == "nginx" && c.Missing == "" {
			nginxIdx = i
		}
	}
	var nginx *contRes
	if nginxIdx >= 0 {
		nginx = b.res[nginxIdx]
	}
	nz := func(f func(*contRes) []latRep) []latRep {
		if nginx == nil {
			return nil
		}
		return f(nginx)
	}
	for i, c := range b.cs {
		cr := ContReport{Name: c.Name, Desc: c.Desc, Missing: c.Missing}
		if c.Missing != "" {
			r.Contenders = append(r.Contenders, cr)
			continue
		}
		x := b.res[i]
		cr.Errors, cr.ErrorSamples = x.Errors, x.ErrList
		isDirect := i == 0
		cr.C1 = latFig(x.Lat, direct.Lat, nz(func(c *contRes) []latRep { return c.Lat }), isDirect)
		if cr.C1 != nil {
			cr.C1.RPS = stat(x.LatRPS)
		}
		cr.TTFT = latFig(x.TTFT, direct.TTFT, nz(func(c *contRes) []latRep { return c.TTFT }), isDirect)
		cr.Gap = latFig(x.Gap, direct.Gap, nz(func(c *contRes) []latRep { return c.Gap }), isDirect)
		if len(x.Thr) > 0 {
			cr.Throughput = &ThrFig{RPS: stat(x.Thr), CPU: stat(x.CPU), UpstreamCPU: stat(x.UpCPU)}
			if !isDirect {
				cr.Throughput.Direct = stat(ratios(x.Thr, direct.Thr))
			}
			if nginx != nil && i != nginxIdx {
				cr.Throughput.Nginx = stat(ratios(x.Thr, nginx.Thr))
			}
		}
		cr.Many = x.Many
		r.Contenders = append(r.Contenders, cr)
	}
	r.Targets = r.summary()
	return r
}

func yes(ok bool) string {
	if ok {
		return "yes"
	}
	return "**no**"
}

// Contenders the report names (bench/run.sh): the remote hop done with
// well-known parts, and the local path logging at info (counted only).
const (
	nginxTLSName = "nginx-tls"
	infoName     = "infermesh-info"
)

// live returns the measured contender named name, or nil.
func (r *Report) live(name string) *ContReport {
	for i := range r.Contenders {
		if c := &r.Contenders[i]; c.Name == name && c.Missing == "" {
			return c
		}
	}
	return nil
}

// summary is the report's first table: each of the targets with
// this run's figure, its goal and whether it was met, in a fixed order;
// a row whose figure was not measured says why, met "n/a".
func (r *Report) summary() []TargetCheck {
	if len(r.Contenders) == 0 { // the routing phase alone
		return r.routingRows()
	}
	im, ng, q := r.live("infermesh"), r.live("nginx"), r.live(quicName)
	return append([]TargetCheck{
		localLatencyRow(im, ng, "p99", func(f *LatFig) (*Stat, float64) { return f.AddedP99, f.AddedP99Nginx }),
		localLatencyRow(im, ng, "p50", func(f *LatFig) (*Stat, float64) { return f.AddedP50, f.AddedP50Nginx }),
		localThroughputRow(im, ng, r.live("haproxy")),
		ttftRow(im, ng),
		remoteBoundRow(r, im, q),
		remoteLocalRow(im, q),
		anchorRow(q, r.live(nginxTLSName)),
		remoteStreamsRow(q),
		meshRow(r, 100),
		meshRow(r, 50),
		simRow(r, 1000),
		cpuRow(r),
		instrRow(r),
	}, r.routingRows()...)
}

// notMeasured is a summary row without its figure.
func notMeasured(target, goal, why string) TargetCheck {
	return TargetCheck{Target: target, Figure: "not measured: " + why, Goal: goal, Met: "n/a"}
}

// localLatencyRow is the local path's c=1 added p50 or p99 over nginx's.
func localLatencyRow(im, ng *ContReport, q string, pick func(*LatFig) (*Stat, float64)) TargetCheck {
	target, goal := "local c=1 added "+q+" ÷ nginx's", "≤ 1.0×"
	if im == nil || ng == nil || im.C1 == nil || ng.C1 == nil {
		return notMeasured(target, goal, "needs infermesh and nginx")
	}
	mine, ratio := pick(im.C1)
	theirs, _ := pick(ng.C1)
	if ratio == 0 {
		return notMeasured(target, goal, fmt.Sprintf("nginx added %.0f µs (no ratio)", theirs.Med))
	}
	return TargetCheck{target, fmt.Sprintf("%.2f× (%.0f vs %.0f µs)", ratio, mine.Med, theirs.Med), goal, yes(ratio <= 1)}
}

func localThroughputRow(im, ng, hap *ContReport) TargetCheck {
	target, goal := "local c=64 req/s ÷ nginx's (haproxy's beside it)", "≥ 1.0×"
	if im == nil || ng == nil || im.Throughput == nil || im.Throughput.Nginx == nil {
		return notMeasured(target, goal, "needs infermesh and nginx")
	}
	fig := fmt.Sprintf("%.2f× (%s vs %s req/s)", im.Throughput.Nginx.Med, thousands(im.Throughput.RPS.Med), thousands(ng.Throughput.RPS.Med))
	if hap != nil && hap.Throughput != nil && hap.Throughput.Nginx != nil {
		fig += fmt.Sprintf("; haproxy %.2f×", hap.Throughput.Nginx.Med)
	}
	return TargetCheck{target, fig, goal, yes(im.Throughput.Nginx.Med >= 1)}
}

func ttftRow(im, ng *ContReport) TargetCheck {
	target, goal := "streaming added TTFT p99 ÷ nginx's", "≤ 1.0×"
	if im == nil || ng == nil || im.TTFT == nil || ng.TTFT == nil || ng.TTFT.AddedP99 == nil {
		return notMeasured(target, goal, "needs infermesh and nginx")
	}
	if im.TTFT.AddedP99Nginx == 0 {
		return notMeasured(target, goal, fmt.Sprintf("nginx added %.0f µs (no ratio)", ng.TTFT.AddedP99.Med))
	}
	return TargetCheck{target, fmt.Sprintf("%.2f× (%.0f vs %.0f µs)", im.TTFT.AddedP99Nginx, im.TTFT.AddedP99.Med, ng.TTFT.AddedP99.Med),
		goal, yes(im.TTFT.AddedP99Nginx <= 1)}
}

// remoteBoundRow is PERFORMANCE.md's target for the remote hop, from the
// medians of this run.
func remoteBoundRow(r *Report, im, q *ContReport) TargetCheck {
	target, goal := "remote hop added p50 ÷ 1.25 × (local added p50 + bare HTTP/3 p50)", "≤ 1.0×"
	if q == nil || im == nil || q.C1 == nil || im.C1 == nil || q.C1.AddedP50 == nil || im.C1.AddedP50 == nil {
		return notMeasured(target, goal, "needs infermesh and "+quicName)
	}
	if r.BareH3 == nil {
		why := r.BareH3Note
		if why == "" {
			why = "no bare HTTP/3 exchange (-bare-h3=false)"
		}
		return notMeasured(target, goal, why+"; see `go test -run '^$' -bench RemoteHop ./agent/`")
	}
	remote, local, h3 := q.C1.AddedP50.Med, im.C1.AddedP50.Med, r.BareH3.P50.Med
	bound := 1.25 * (local + h3)
	return TargetCheck{target, fmt.Sprintf("%.2f× (%.0f µs vs 1.25 × (%.0f + %.0f) = %.0f µs)", remote/bound, remote, local, h3, bound),
		goal, yes(remote <= bound)}
}

func remoteLocalRow(im, q *ContReport) TargetCheck {
	target, goal := "remote c=64 req/s ÷ local c=64 req/s", "≥ 0.6×"
	if q == nil || im == nil || q.Throughput == nil || im.Throughput == nil || im.Throughput.RPS.Med == 0 {
		return notMeasured(target, goal, "needs infermesh and "+quicName)
	}
	ratio := q.Throughput.RPS.Med / im.Throughput.RPS.Med
	return TargetCheck{target, fmt.Sprintf("%.2f× (%s vs %s req/s)", ratio, thousands(q.Throughput.RPS.Med), thousands(im.Throughput.RPS.Med)),
		goal, yes(ratio >= 0.6)}
}

// anchorRow compares the remote path with the same hop done by two nginx
// over TLS 1.3 with client certificates, in this run.
func anchorRow(q, a *ContReport) TargetCheck {
	target, goal := "remote hop vs "+nginxTLSName+" (nginx → TLS 1.3, client certificates → nginx): added p50 ÷, c=64 ÷", "≤ 1.0×, ≥ 1.0×"
	if q == nil || a == nil || q.C1 == nil || a.C1 == nil || q.C1.AddedP50 == nil || a.C1.AddedP50 == nil ||
		q.Throughput == nil || a.Throughput == nil || a.Throughput.RPS.Med == 0 || a.C1.AddedP50.Med <= 0 {
		return notMeasured(target, goal, "needs "+quicName+" and "+nginxTLSName)
	}
	p50 := q.C1.AddedP50.Med / a.C1.AddedP50.Med
	thr := q.Throughput.RPS.Med / a.Throughput.RPS.Med
	return TargetCheck{target,
		fmt.Sprintf("added p50 %.2f× (%.0f vs %.0f µs); c=64 %.2f× (%s vs %s req/s)", p50, q.C1.AddedP50.Med, a.C1.AddedP50.Med,
			thr, thousands(q.Throughput.RPS.Med), thousands(a.Throughput.RPS.Med)),
		goal, yes(p50 <= 1 && thr >= 1)}
}

// remoteStreamsRow is the remote path's 4096-stream level: every stream
// whole and on time, and the RSS per open stream of a + b.
func remoteStreamsRow(q *ContReport) TargetCheck {
	target, goal := "remote 4096 concurrent streams: stalls; RSS per open stream (a + b)", "0 stalls, ≤ 64 KiB"
	if q == nil || len(q.Many) == 0 {
		return notMeasured(target, goal, "needs "+quicName+" and a concurrent-streams level")
	}
	for _, m := range q.Many {
		if m.Streams == 4096 {
			return TargetCheck{target, manyFigure(m), goal,
				yes(m.Completed == m.Streams && m.SlowStarts == 0 && m.StalledFrames == 0 && m.DroppedFrames == 0 && m.KiBPerStream <= 64)}
		}
	}
	m := q.Many[0] // the largest level, on a fresh process
	return TargetCheck{target, fmt.Sprintf("4096 not run; at %d: %s", m.Streams, manyFigure(m)), goal, "n/a"}
}

func manyFigure(m manyRes) string {
	return fmt.Sprintf("%d of %d completed, %d slow starts, %d stalled and %d dropped frames; %.1f KiB per stream",
		m.Completed, m.Streams, m.SlowStarts, m.StalledFrames, m.DroppedFrames, m.KiBPerStream)
}

// meshRow is the real mesh (mesh/meshbench) at n nodes: membership
// formation within 3 s, and at 100 nodes the advert within 1 s; at 50 a
// failure is itself the target missed.
func meshRow(r *Report, n int) TargetCheck {
	target, goal := fmt.Sprintf("mesh N=%d real: membership complete", n), "≤ 3 s, never fails"
	if n == 100 {
		target, goal = "mesh N=100 real: membership complete; advert reaches all", "≤ 3 s; ≤ 1 s"
	}
	i := slices.IndexFunc(r.Mesh, func(m meshRes) bool { return m.N == n })
	if i < 0 {
		return notMeasured(target, goal, fmt.Sprintf("N=%d not run (%s)", n, runNs(r.Mesh, func(m meshRes) int { return m.N })))
	}
	m := r.Mesh[i]
	memb, okM := durOf(m.Membership)
	met := okM && memb <= 3*time.Second && m.Err == ""
	fig := orFailed(m.Membership, m.Err)
	if n == 100 {
		adv, okA := durOf(m.Advert)
		met = okM && okA && memb <= 3*time.Second && adv <= time.Second
		fig = orFailed(m.Membership, m.Err) + "; " + orFailed(m.Advert, m.Err)
		if okM && m.Advert == "" && m.Err != "" {
			fig = m.Membership + "; " + orFailed("", m.Err)
		}
	}
	return TargetCheck{target, fig, goal, yes(met)}
}

// simRow is the simulation (mesh/meshsim) at n nodes: the advert reaches
// everyone within 3 s (simulated) and its queue drains.
func simRow(r *Report, n int) TargetCheck {
	target, goal := fmt.Sprintf("sim N=%d: advert reaches all; advert queue at the end of the window", n), "≤ 3 s; empty (not starving)"
	i := slices.IndexFunc(r.Sim, func(m simRes) bool { return m.N == n })
	if i < 0 {
		return notMeasured(target, goal, fmt.Sprintf("N=%d not run (%s)", n, runNs(r.Sim, func(m simRes) int { return m.N })))
	}
	m := r.Sim[i]
	adv, ok := durOf(m.Advert)
	return TargetCheck{target, fmt.Sprintf("%s; %d (max %d)", orFailed(m.Advert, m.Err), m.AdvertQueueEnd, m.AdvertQueueMax),
		goal, yes(ok && adv <= 3*time.Second && m.AdvertQueueEnd == 0 && m.Err == "")}
}

// runNs says which node counts ran.
func runNs[T any](xs []T, n func(T) int) string {
	if len(xs) == 0 {
		return "none ran"
	}
	var s []string
	for _, x := range xs {
		s = append(s, strconv.Itoa(n(x)))
	}
	return "ran N=" + strings.Join(s, ", ")
}

// durOf parses a figure written with time.Duration's String.
func durOf(s string) (time.Duration, bool) {
	d, err := time.ParseDuration(s)
	return d, err == nil && s != ""
}

// cpuRow lists every contender's CPU per request at c=64, the
// efficiency figure on a shared host (throughput alone moves with the
// load; CPU per request much less).
func cpuRow(r *Report) TargetCheck {
	target, goal := "CPU per request at c=64 (µs, median; the contender's processes, the upstream's after +)", "reported"
	var parts []string
	for _, c := range r.Contenders {
		if t := c.Throughput; t != nil && t.CPU != nil {
			p := fmt.Sprintf("%s %.1f", c.Name, t.CPU.Med)
			if c.Name != r.Contenders[0].Name && t.UpstreamCPU != nil {
				p += fmt.Sprintf(" + %.1f", t.UpstreamCPU.Med)
			}
			parts = append(parts, p)
		}
	}
	if len(parts) == 0 {
		return notMeasured(target, goal, "no process ids (cpu_pids) from bench/run.sh")
	}
	if warn, info := r.live("infermesh"), r.live(infoName); warn != nil && info != nil && warn.Throughput != nil && info.Throughput != nil &&
		warn.Throughput.CPU != nil && info.Throughput.CPU != nil {
		parts = append(parts, fmt.Sprintf("the access log (level info, to a file) costs %.1f µs", info.Throughput.CPU.Med-warn.Throughput.CPU.Med))
	}
	return TargetCheck{target, strings.Join(parts, "; "), goal, "–"}
}

// instrRow lists every counted contender's instructions per request.
func instrRow(r *Report) TargetCheck {
	target, goal := "instructions per request (callgrind, c=1)", "reported"
	var parts []string
	nginx := r.instrPer("nginx")
	for _, ic := range r.Instructions {
		if ic.Requests == 0 {
			continue
		}
		per := float64(ic.Instructions) / float64(ic.Requests)
		p := fmt.Sprintf("%s %s", ic.Name, thousands(per))
		if nginx > 0 && ic.Name != "nginx" {
			p += fmt.Sprintf(" (%.2f× nginx)", per/nginx)
		}
		parts = append(parts, p)
	}
	if len(parts) == 0 {
		return notMeasured(target, goal, "no instruction counts (valgrind missing?)")
	}
	if warn, info := r.instrPer("infermesh"), r.instrPer(infoName); warn > 0 && info > 0 {
		// zap's production sampler writes the first 100 lines a second
		// of one message, then 1 in 100: under callgrind the requests
		// come at about that rate, so only some are written.
		ic := r.Instructions[slices.IndexFunc(r.Instructions, func(ic instrCount) bool { return ic.Name == infoName })]
		p := fmt.Sprintf("the access log (level info, to a file) costs %s per request, %d lines written for %d requests (zap's sampler)",
			thousands(info-warn), ic.Logged, ic.Requests)
		if ic.Logged > 0 {
			p += fmt.Sprintf(", at most %s per line written", thousands((info-warn)*float64(ic.Requests)/float64(ic.Logged)))
		}
		parts = append(parts, p)
	}
	return TargetCheck{target, strings.Join(parts, "; "), goal, "–"}
}

// instrPer is name's instructions per request, 0 when not counted.
func (r *Report) instrPer(name string) float64 {
	for _, ic := range r.Instructions {
		if ic.Name == name && ic.Requests > 0 {
			return float64(ic.Instructions) / float64(ic.Requests)
		}
	}
	return 0
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
		}
	}
	return ""
}

func thousands(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []byte
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "-" + string(out)
	}
	return string(out)
}

// fmtStat prints a median with its spread: "85 (80–90)".
func fmtStat(s *Stat, f func(float64) string) string {
	if s == nil {
		return ""
	}
	if s.N < 2 || f(s.Min) == f(s.Max) {
		return f(s.Med)
	}
	return fmt.Sprintf("%s <sub>%s–%s</sub>", f(s.Med), f(s.Min), f(s.Max))
}

func fmtUS(v float64) string    { return fmt.Sprintf("%.0f", v) }
func fmtCPU(v float64) string   { return fmt.Sprintf("%.1f", v) }
func fmtRatio(v float64) string { return fmt.Sprintf("%.2f×", v) }

// Markdown renders the report.
func (r *Report) Markdown() string {
	var sb strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&sb, format, args...) }
	p := r.Params
	w("# infermesh bench (%s), %s\n\n", r.Mode, r.Started.UTC().Format("2006-01-02 15:04 UTC"))
	w("%d cores (%s), %s", r.Cores, r.CPU, r.GoVersion)
	for _, k := range slices.Sorted(maps.Keys(r.Meta)) {
		w(", %s %s", k, r.Meta[k])
	}
	if len(r.Contenders) == 0 {
		w("; the routing phase alone; the load generator took %s, the whole run %s.\n\n", r.Elapsed, r.Total)
	} else {
		w("; loopback, HTTP/1.1 keep-alive; %d interleaved repetitions, medians with the spread (min–max) in small print; the load generator took %s, the whole run %s.\n\n", p.Reps, r.Elapsed, r.Total)
	}
	w("Load average (1, 5, 15 min): %s at the start, %s at the end.\n\n", orUnknown(r.LoadStart), orUnknown(r.LoadEnd))
	if len(r.Phases) > 0 {
		var ps []string
		for _, ph := range r.Phases {
			ps = append(ps, fmt.Sprintf("%s %s", ph.Name, fmtSeconds(ph.Seconds)))
		}
		w("Phases: %s; total %s.\n\n", strings.Join(ps, "; "), r.Total)
	}
	if len(r.Targets) > 0 {
		w("## Summary: the targets (reported, never asserted)\n\n")
		if len(r.Contenders) > 0 {
			w("Local path: infermesh; remote path: %s (added figures are a path's own minus direct's, per repetition); medians of this run. ", quicName)
		}
		w("Routing rows: the routing section's figures (one run each). n/a: not measured in this run (the row says why).\n\n")
		w("| target | this run | goal | met |\n| --- | --- | --- | --- |\n")
		for _, t := range r.Targets {
			w("| %s | %s | %s | %s |\n", t.Target, strings.ReplaceAll(t.Figure, "|", "/"), t.Goal, t.Met)
		}
		w("\n")
	}

	if len(r.Contenders) == 0 {
		if r.Routing != nil {
			r.Routing.markdown(w)
		}
		return sb.String()
	}

	na := func(c ContReport, cols int) bool {
		if c.Missing == "" {
			return false
		}
		w("| %s | n/a (%s) |%s\n", c.Name, c.Missing, strings.Repeat(" |", cols-1))
		return true
	}

	w("## c=1: small chat completion, one request at a time (µs)\n\n")
	w("| path | p50 | p99 | added p50 | added p99 | p99 ÷ direct | added p50 ÷ nginx | added p99 ÷ nginx | req/s |\n")
	w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, c := range r.Contenders {
		if na(c, 9-1) || c.C1 == nil {
			continue
		}
		f := c.C1
		w("| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c.Name, fmtStat(f.P50, fmtUS), fmtStat(f.P99, fmtUS),
			fmtStat(f.AddedP50, fmtUS), fmtStat(f.AddedP99, fmtUS), fmtStat(f.P99Direct, fmtRatio),
			ratioOrBlank(f.AddedP50Nginx, c.Name), ratioOrBlank(f.AddedP99Nginx, c.Name), fmtStat(f.RPS, thousands))
	}

	switch {
	case r.BareH3 != nil:
		w("\nBare HTTP/3 exchange, the floor of the remote hop (two mesh transports, QUIC and TLS 1.3 with client certificates, both ends in the load generator's process; a small chat completion; interleaved with the rows above): p50 %s µs, p99 %s µs. `go test -run '^$' -bench RemoteHop ./agent/` measures it apart.\n",
			fmtStat(r.BareH3.P50, fmtUS), fmtStat(r.BareH3.P99, fmtUS))
	case r.BareH3Note != "":
		w("\nBare HTTP/3 exchange: %s; `go test -run '^$' -bench RemoteHop ./agent/` measures it apart.\n", r.BareH3Note)
	}

	w("\n## c=%d: requests per second\n\n", p.Conc)
	w("CPU per request: the user + system CPU of the path's processes (with their children and threads: nginx's master and workers, both agents or both nginx of a two-hop path) over each repetition, divided by the requests it completed; the upstream's beside it (direct's is the upstream's alone). On a shared 2-core host requests per second move with the load; CPU per request much less.\n\n")
	w("| path | req/s | ÷ direct | ÷ nginx | CPU µs per request | upstream CPU µs per request |\n| --- | --- | --- | --- | --- | --- |\n")
	for i, c := range r.Contenders {
		if na(c, 6-1) || c.Throughput == nil {
			continue
		}
		t := c.Throughput
		up := fmtStat(t.UpstreamCPU, fmtCPU)
		if i == 0 {
			up = ""
		}
		w("| %s | %s | %s | %s | %s | %s |\n", c.Name, fmtStat(t.RPS, thousands), fmtStat(t.Direct, fmtRatio), fmtStat(t.Nginx, fmtRatio), fmtStat(t.CPU, fmtCPU), up)
	}

	w("\n## Streaming: %d deltas %v apart, %d streams at a time (µs)\n\n", p.StreamTokens, p.StreamDelay, p.StreamConc)
	w("Time to first token (first `data:` event) and the gap between deltas minus the upstream's %v pacing; added = minus direct.\n\n", p.StreamDelay)
	w("| path | TTFT p50 | TTFT p99 | added TTFT p50 | added TTFT p99 | added TTFT p99 ÷ nginx | gap p50 | gap p99 | added per-frame p50 | added per-frame p99 |\n")
	w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, c := range r.Contenders {
		if na(c, 11-1) || c.TTFT == nil {
			continue
		}
		t, g := c.TTFT, c.Gap
		w("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c.Name, fmtStat(t.P50, fmtUS), fmtStat(t.P99, fmtUS),
			fmtStat(t.AddedP50, fmtUS), fmtStat(t.AddedP99, fmtUS), ratioOrBlank(t.AddedP99Nginx, c.Name),
			fmtStat(g.P50, fmtUS), fmtStat(g.P99, fmtUS), fmtStat(g.AddedP50, fmtUS), fmtStat(g.AddedP99, fmtUS))
	}

	w("\n## Concurrent streams: %d deltas %v apart, opened at %d/s, each on its own connection\n\n", p.ManyTokens, p.ManyDelay, p.ManyRate)
	w("A slow start is a stream whose first delta came more than %v after the request; a stalled frame came more than %v after the previous delta; dropped frames are missing from streams cut short. RSS is the proxy process's VmRSS before and at the peak of the first (largest) level, run first on a fresh process (later levels reuse its heap); the direct row shows the upstream's, a row of two agents (%s) their sum.\n\n", p.StallAfter, p.StallAfter, quicName)
	w("| path | streams | completed | peak open | slow starts | stalled frames | dropped frames | RSS before → peak (MiB) | KiB per open stream | MiB per 1000 streams |\n")
	w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, c := range r.Contenders {
		if na(c, 10-1) {
			continue
		}
		for i, m := range c.Many {
			rss := "| | |"
			if i == 0 {
				rss = fmt.Sprintf("%.1f → %.1f | %.1f | %.1f |", float64(m.RSSBeforeKiB)/1024, float64(m.RSSPeakKiB)/1024, m.KiBPerStream, m.KiBPerStream*1000/1024)
			}
			w("| %s | %d | %d | %d | %d | %d | %d | %s\n", c.Name, m.Streams, m.Completed, m.PeakOpen,
				m.SlowStarts, m.StalledFrames, m.DroppedFrames, rss)
		}
	}
	for _, c := range r.Contenders {
		capped := 0
		for _, m := range c.Many {
			if m.PeakOpen < m.Streams {
				capped = max(capped, m.PeakOpen)
			}
		}
		if capped == 0 {
			continue
		}
		w("\n%s: at most %d streams were open at once (peak open); the others got their first delta late (slow starts), and its RSS per stream divides by every request in flight, streaming or not yet.", c.Name, capped)
		if c.Name == quicName && capped <= mesh.DefaultMaxStreamsPerPeer+32 {
			w(" Agent a sends them to b over one QUIC connection, which carries at most mesh.TransportConfig.MaxStreamsPerPeer concurrent requests (default mesh.DefaultMaxStreamsPerPeer = %d; no config key sets it): the rest wait at a for a stream, a whole stream's length.", mesh.DefaultMaxStreamsPerPeer)
		}
		w("\n")
	}
	for _, c := range r.Contenders {
		if len(c.Many) == 0 || len(c.Many[0].RSSParts) == 0 {
			continue
		}
		m := c.Many[0]
		var parts []string
		for _, pt := range m.RSSParts {
			name := fmt.Sprintf("pid %d", pt.PID)
			if pt.Name != "" {
				name = fmt.Sprintf("%s (pid %d)", pt.Name, pt.PID)
			}
			parts = append(parts, fmt.Sprintf("%s %.1f → %.1f MiB (%.1f KiB per stream)", name,
				float64(pt.BeforeKiB)/1024, float64(pt.PeakKiB)/1024, float64(pt.PeakKiB-pt.BeforeKiB)/float64(m.Streams)))
		}
		w("\n%s's RSS is the sum of its processes, sampled together; at %d streams: %s.\n", c.Name, m.Streams, strings.Join(parts, "; "))
	}
	if len(r.Instructions) > 0 {
		w("\n## Instructions per request (callgrind)\n\n")
		w("Each proxy alone under valgrind's callgrind: small chat completions at c=1 over one keep-alive connection after a warm-up, counted over the proxy's processes only (both agents for %s). A count does not depend on the host's load; Go programs ran with GODEBUG=asyncpreemptoff=1.\n\n", quicName)
		var nginx float64
		for _, ic := range r.Instructions {
			if ic.Name == "nginx" && ic.Requests > 0 {
				nginx = float64(ic.Instructions) / float64(ic.Requests)
			}
		}
		w("| contender | requests | instructions per request | ÷ nginx |\n| --- | --- | --- | --- |\n")
		for _, ic := range r.Instructions {
			if ic.Requests == 0 {
				continue
			}
			per := float64(ic.Instructions) / float64(ic.Requests)
			ratio := "–"
			if nginx > 0 {
				ratio = fmt.Sprintf("%.2f×", per/nginx)
			}
			w("| %s | %d | %.0f | %s |\n", ic.Name, ic.Requests, per, ratio)
		}
	}
	if len(r.Mesh) > 0 {
		w("\n## Mesh: in-process nodes on loopback (mesh/meshbench, %s profile)\n\n", r.Mesh[0].Profile)
		w("| N | membership complete | advert reached all | death noticed by all |\n| --- | --- | --- | --- |\n")
		for _, m := range r.Mesh {
			cell := func(v string) string { return orFailed(v, m.Err) }
			w("| %d | %s | %s | %s |\n", m.N, cell(m.Membership), cell(m.Advert), cell(m.Death))
		}
	}
	if len(r.Sim) > 0 {
		w("\n## Mesh simulation: nodes in one process over an in-memory network (mesh/meshsim, LAN profile, %v one-way latency)\n\n", simLatency)
		w("Real meshes (keys, certificates, signatures, encrypted gossip) over simulated sockets. Time is dilated N/25 times (at least 1): every protocol interval and timeout and the latency are multiplied by it and every figure is in simulated time, so each node gets the CPU per protocol round that 25 nodes get at scale 1 (a real fleet has a CPU per node; undilated, 1000 nodes on 2 cores measure the starved host). Traffic is over 5 simulated seconds right after the advert reached everyone: memberlist is then still retransmitting the alive message of every member of a fleet that formed at once (for about N/5 simulated seconds), so it is the tail of formation, not a quiet mesh (`MESHSIM_SETTLE=40s go test -run ^$ -bench Sim/N=100 ./mesh/meshsim` measures after that); adverts are their broadcasts and push/pull state, membership is the rest. Push/pulls are the anti-entropy ones all nodes started, while forming + in the window. Advert queue: the longest any node held when the advert had reached everyone / at the end of the window (a starving queue stays full). CPU is the simulation process's, in wall time.\n\n")
		w("| N | time scale | membership complete | advert reached all | advert queue max / end | push/pulls | bytes/node/s: adverts | membership | sent per node while forming | heap per node | CPU s / wall s | queue overflows |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
		for _, m := range r.Sim {
			cell := func(v string) string { return orFailed(v, m.Err) }
			w("| %d | %g | %s | %s | %d / %d | %d + %d | %.0f | %.0f | %.0f KiB | %d KiB | %.0f / %.0f | %d |\n", m.N, m.TimeScale, cell(m.Membership), cell(m.Advert), m.AdvertQueueMax, m.AdvertQueueEnd,
				m.FormPushPulls, m.SteadyPushPulls, m.AdvertBytesNodeS, m.BytesPerNodeSec-m.AdvertBytesNodeS, m.FormBytesPerNode/1024, m.HeapPerNodeKiB, m.CPUSeconds, m.WallSeconds, m.Overflows)
		}
	}
	if r.Routing != nil {
		r.Routing.markdown(w)
	}
	if n := r.Errors(); n > 0 {
		w("\n## Errors\n\n")
		for _, c := range r.Contenders {
			for _, e := range c.ErrorSamples {
				w("- %s: %s\n", c.Name, e)
			}
		}
	}
	return sb.String()
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func ratioOrBlank(v float64, name string) string {
	if v == 0 || name == "nginx" {
		return ""
	}
	return fmtRatio(v)
}

// orFailed is a table cell: v, or the failure when v was not measured.
func orFailed(v, err string) string {
	if v == "" && err != "" {
		return "failed: " + strings.ReplaceAll(err, "|", "/")
	}
	return v
}

// instrCount is one contender's instruction count (bench/run.sh).
type instrCount struct {
	Name         string `json:"name"`
	Requests     int    `json:"requests"`
	Instructions int64  `json:"instructions"`
	// Logged is the access-log lines the contender wrote for them.
	Logged int `json:"logged"`
}
