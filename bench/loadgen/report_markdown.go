package main

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/infermesh/infermesh/mesh"
)

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
		w("Real meshes (keys, certificates, signatures, encrypted gossip) over simulated sockets. Time is dilated N/25 times (at least 1): every protocol interval and timeout and the latency are multiplied by it and every figure is in simulated time, so each node gets the CPU per protocol round that 25 nodes get at scale 1 (a real fleet has a CPU per node; undilated, 1000 nodes on 2 cores measure the starved host). Traffic is over %v simulated right after the advert reached everyone: memberlist is then still retransmitting the alive message of every member of a fleet that formed at once (for about N/5 simulated seconds), so it is the tail of formation, not a quiet mesh (`MESHSIM_SETTLE=40s go test -run ^$ -bench Sim/N=100 ./mesh/meshsim` measures after that); the origin's load and capacity change every simulated second (an engine under traffic), and its adverts carry them within mesh.Config.AdvertLoadBudget; adverts are their broadcasts and push/pull state, membership is the rest. Push/pulls are the anti-entropy ones all nodes started, while forming + in the window. Advert queue: the longest any node held when the advert had reached everyone / at the end of the window (a starving queue stays full). CPU is the simulation process's, in wall time.\n\n", simWindow)
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
