package main

import (
	"os"
	"runtime"
	"slices"
	"strings"
	"time"
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

// instrCount is one contender's instruction count (bench/run.sh).
type instrCount struct {
	Name         string `json:"name"`
	Requests     int    `json:"requests"`
	Instructions int64  `json:"instructions"`
	// Logged is the access-log lines the contender wrote for them.
	Logged int `json:"logged"`
}
