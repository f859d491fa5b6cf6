package main

import (
	"fmt"
	"maps"
	"os"
	"runtime"
	"slices"
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
	BareH3     *LatFig       `json:"bare_h3_c1,omitempty"`
	BareH3Note string        `json:"bare_h3_note,omitempty"`
	Targets    []TargetCheck `json:"targets"`
}

// TargetCheck is one of the targets, reported (never asserted).
type TargetCheck struct {
	Target string `json:"target"`
	Figure string `json:"figure"`
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

func (b *bench) report(meta map[string]string) *Report {
	mode := "full"
	if b.p.Quick {
		mode = "quick"
	}
	r := &Report{
		Started: b.started, Elapsed: time.Since(b.started).Round(time.Second).String(), Mode: mode,
		Cores: runtime.NumCPU(), CPU: cpuModel(), GoVersion: runtime.Version(), Meta: meta, Params: b.p, Mesh: b.mesh, Sim: b.sim,
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
			cr.Throughput = &ThrFig{RPS: stat(x.Thr)}
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
	r.Targets = b.targets(r)
	return r
}

func yes(ok bool) string {
	if ok {
		return "yes"
	}
	return "**no**"
}

// targets compares infermesh's local and remote paths with the issue's
// targets.
func (b *bench) targets(r *Report) []TargetCheck {
	var im, ng, q, ngTLS *ContReport
	for i := range r.Contenders {
		switch c := &r.Contenders[i]; {
		case c.Name == nginxTLSName && c.Missing == "":
			ngTLS = c
		case c.Name == "infermesh" && c.Missing == "":
			im = c
		case c.Name == "nginx" && c.Missing == "":
			ng = c
		case c.Name == quicName && c.Missing == "":
			q = c
		}
	}
	if im == nil {
		return nil
	}
	out := localTargets(im, ng)
	if q != nil {
		out = append(out, remoteTargets(r, im, q)...)
		out = append(out, anchorTargets(q, ngTLS)...)
		out = append(out, streamTargets(q, " through the remote path", " (a + b)")...)
	}
	return out
}

// nginxTLSName is the remote hop done with well-known parts (bench/run.sh).
const nginxTLSName = "nginx-tls"

// anchorTargets compares the remote path with the same hop done by two
// nginx over TLS 1.3 with client certificates, in this run.
func anchorTargets(q, a *ContReport) []TargetCheck {
	if a == nil {
		return nil
	}
	var out []TargetCheck
	if q.C1 != nil && a.C1 != nil && q.C1.AddedP50 != nil && a.C1.AddedP50 != nil {
		out = append(out, TargetCheck{"remote hop added p50 ≤ " + nginxTLSName + "'s (nginx → TLS 1.3, client certificates → nginx)",
			fmt.Sprintf("%.0f µs vs %.0f µs (%.2f×)", q.C1.AddedP50.Med, a.C1.AddedP50.Med, q.C1.AddedP50.Med/a.C1.AddedP50.Med),
			yes(q.C1.AddedP50.Med <= a.C1.AddedP50.Med)})
	}
	if q.Throughput != nil && a.Throughput != nil && q.Throughput.RPS != nil && a.Throughput.RPS != nil && a.Throughput.RPS.Med > 0 {
		out = append(out, TargetCheck{"remote hop c=64 throughput ≥ " + nginxTLSName + "'s",
			fmt.Sprintf("%.2f× (%s vs %s req/s)", q.Throughput.RPS.Med/a.Throughput.RPS.Med, thousands(q.Throughput.RPS.Med), thousands(a.Throughput.RPS.Med)),
			yes(q.Throughput.RPS.Med >= a.Throughput.RPS.Med)})
	}
	return out
}

// remoteTargets reports the remote hop against the target and
// PERFORMANCE.md's form of it, from the medians of this run.
func remoteTargets(r *Report, im, q *ContReport) []TargetCheck {
	direct := r.Contenders[0]
	if q.C1 == nil || im.C1 == nil || direct.C1 == nil || q.C1.AddedP50 == nil || im.C1.AddedP50 == nil {
		return nil
	}
	remote, local, rtt := q.C1.AddedP50.Med, im.C1.AddedP50.Med, direct.C1.P50.Med
	bound := 2*local + rtt
	out := []TargetCheck{{
		"remote hop added p50 ≤ 2 × local-path added p50 + loopback round trip (direct p50 at c=1)",
		fmt.Sprintf("%.0f µs vs 2 × %.0f + %.0f = %.0f µs (%.2f× the bound)", remote, local, rtt, bound, remote/bound),
		yes(remote <= bound),
	}}
	const perf = "remote path added p50 ≤ 1.25 × (local-path added p50 + bare HTTP/3 exchange p50) (PERFORMANCE.md)"
	if r.BareH3 == nil {
		why := r.BareH3Note
		if why == "" {
			why = "not measured (-bare-h3=false)"
		}
		out = append(out, TargetCheck{perf, why + "; see `go test -run '^$' -bench RemoteHop ./agent/`", "n/a"})
		return out
	}
	h3 := r.BareH3.P50.Med
	pb := 1.25 * (local + h3)
	out = append(out, TargetCheck{perf,
		fmt.Sprintf("%.0f µs vs 1.25 × (%.0f + %.0f) = %.0f µs (%.2f× the bound)", remote, local, h3, pb, remote/pb),
		yes(remote <= pb)})
	return out
}

// localTargets reports infermesh's local path against the targets.
func localTargets(im, ng *ContReport) []TargetCheck {
	var out []TargetCheck
	if ng != nil && im.C1 != nil && ng.C1 != nil && im.C1.AddedP99 != nil && ng.C1.AddedP99 != nil {
		out = append(out, TargetCheck{"c=1 added p99 ≤ nginx's added p99",
			fmt.Sprintf("%.0f µs vs %.0f µs (%.2f×)", im.C1.AddedP99.Med, ng.C1.AddedP99.Med, im.C1.AddedP99Nginx),
			yes(im.C1.AddedP99.Med <= ng.C1.AddedP99.Med)})
	}
	if im.Throughput != nil && im.Throughput.Nginx != nil {
		out = append(out, TargetCheck{"c=64 throughput ≥ 0.9 × nginx",
			fmt.Sprintf("%.2f× (%s vs %s req/s)", im.Throughput.Nginx.Med, thousands(im.Throughput.RPS.Med), thousands(ng.Throughput.RPS.Med)),
			yes(im.Throughput.Nginx.Med >= 0.9)})
	}
	return append(out, streamTargets(im, "", "")...)
}

// streamTargets reports c's 4096-stream level (when run) against the
// streams and memory targets.
func streamTargets(c *ContReport, path, rss string) []TargetCheck {
	var out []TargetCheck
	for _, m := range c.Many {
		if m.Streams != 4096 {
			continue
		}
		out = append(out, TargetCheck{"4096 concurrent streams" + path + ", zero stalls",
			fmt.Sprintf("%d completed, peak open %d, %d slow starts, %d stalled frames, %d dropped frames", m.Completed, m.PeakOpen, m.SlowStarts, m.StalledFrames, m.DroppedFrames),
			yes(m.Completed == m.Streams && m.SlowStarts == 0 && m.StalledFrames == 0 && m.DroppedFrames == 0)})
		out = append(out, TargetCheck{"RSS ≤ 64 KiB per open stream" + rss,
			fmt.Sprintf("%.1f KiB per stream (%.1f MiB per 1000)", m.KiBPerStream, m.KiBPerStream*1000/1024),
			yes(m.KiBPerStream <= 64)})
	}
	return out
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
	w("; loopback, HTTP/1.1 keep-alive; %d interleaved repetitions, medians with the spread (min–max) in small print; took %s.\n\n", p.Reps, r.Elapsed)

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
	w("| path | req/s | ÷ direct | ÷ nginx |\n| --- | --- | --- | --- |\n")
	for _, c := range r.Contenders {
		if na(c, 4-1) || c.Throughput == nil {
			continue
		}
		t := c.Throughput
		w("| %s | %s | %s | %s |\n", c.Name, fmtStat(t.RPS, thousands), fmtStat(t.Direct, fmtRatio), fmtStat(t.Nginx, fmtRatio))
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
	if len(r.Targets) > 0 {
		w("\n## Targets (reported, never asserted)\n\n")
		w("Local path: infermesh; remote path: %s (its added figures are its own minus direct's, per repetition); medians of this run.\n\n", quicName)
		w("| target | this run | met |\n| --- | --- | --- |\n")
		for _, t := range r.Targets {
			w("| %s | %s | %s |\n", t.Target, t.Figure, t.Met)
		}
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
}
