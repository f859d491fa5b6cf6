package main

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

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
		simAdvertRow(r, 1000),
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

// simAdvertBefore is the advert bytes per node per second at N=1000 before
// adverts carried capacity (one advert, its load never changing).
const simAdvertBefore = 422

// simAdvertRow is the simulation's advert traffic at n nodes with the
// origin's load changing every second: at most twice what it was before
// adverts carried capacity.
func simAdvertRow(r *Report, n int) TargetCheck {
	target, goal := fmt.Sprintf("sim N=%d: advert bytes per node per second, the origin's load changing every second", n), fmt.Sprintf("≤ 2 × %d", simAdvertBefore)
	i := slices.IndexFunc(r.Sim, func(m simRes) bool { return m.N == n })
	if i < 0 {
		return notMeasured(target, goal, fmt.Sprintf("N=%d not run (%s)", n, runNs(r.Sim, func(m simRes) int { return m.N })))
	}
	m := r.Sim[i]
	if m.Err != "" || m.LoadChanges == 0 {
		return TargetCheck{target, strings.TrimSpace(orFailed("", m.Err) + fmt.Sprintf(" (%d load changes)", m.LoadChanges)), goal, yes(false)}
	}
	return TargetCheck{target, fmt.Sprintf("%.0f (%.2f×; %d load changes; the stalest node %s behind, %d with none)", m.AdvertBytesNodeS, m.AdvertBytesNodeS/simAdvertBefore, m.LoadChanges, m.LoadStale, m.LoadMissing),
		goal, yes(m.AdvertBytesNodeS <= 2*simAdvertBefore)}
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
