package main

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Names bench/run.sh gives the routing topologies and rows, which the
// summary's targets refer to.
const (
	// routingPeers: a consumer without an instance and three serving
	// peers; routingLocal: a consumer that serves the role itself too,
	// beside the same three.
	routingPeers = "peers"
	routingLocal = "local"
	// meshOne is infermesh through one consumer; meshTwo through two
	// consumers sharing the peers.
	meshOne = "infermesh"
	meshTwo = "infermesh-2"
)

// topology returns the measured topology called name, or nil.
func (rr *RoutingResults) topology(name string) *TopologyResult {
	if rr == nil {
		return nil
	}
	for i := range rr.Topologies {
		if rr.Topologies[i].Name == name {
			return &rr.Topologies[i]
		}
	}
	return nil
}

// run returns row's run at factor (of capacity), or nil.
func (t *TopologyResult) run(row string, factor float64) *RunResult {
	if t == nil {
		return nil
	}
	for i := range t.Runs {
		if r := &t.Runs[i]; r.Row == row && r.Factor == factor {
			return r
		}
	}
	return nil
}

// routingRows are the summary's rows for the routing targets, computed
// from this run's figures; n/a where the run lacks them.
func (r *Report) routingRows() []TargetCheck {
	rr := r.Routing
	peers, local := rr.topology(routingPeers), rr.topology(routingLocal)
	at := func(t *TopologyResult, row string, f float64) *RunResult { return t.run(row, f) }
	const about, over = 1.0, 1.3
	var slots int
	if rr != nil {
		slots = rr.Engine.Slots
	}
	ttftRow := func(target, goal string, t *TopologyResult, row, anchor string, limit float64) TargetCheck {
		im, an := at(t, row, about), at(t, anchor, about)
		if im == nil || an == nil {
			return notMeasured(target, goal, "no "+row+" and "+anchor+" runs at 1× capacity")
		}
		if an.TTFT90 <= 0 {
			return notMeasured(target, goal, anchor+"'s TTFT p90 is 0")
		}
		q := im.TTFT90 / an.TTFT90
		return TargetCheck{target, fmt.Sprintf("%.2f× (%s vs %s ms)", q, thousands(im.TTFT90), thousands(an.TTFT90)), goal, yes(q <= limit)}
	}
	hitRow := func(target, goal string, row string, limit float64) TargetCheck {
		im, or := at(peers, row, about), at(peers, "oracle", about)
		if im == nil || or == nil || or.HitRatio <= 0 {
			return notMeasured(target, goal, "no "+row+" and oracle runs at 1× capacity")
		}
		q := im.HitRatio / or.HitRatio
		return TargetCheck{target, fmt.Sprintf("%.2f× (%.2f vs %.2f)", q, im.HitRatio, or.HitRatio), goal, yes(q >= limit)}
	}
	rows := []TargetCheck{
		ttftRow("routing, about capacity: infermesh TTFT p90 ÷ direct oracle's", "≤ 1.25×", peers, meshOne, "oracle", 1.25),
		ttftRow("routing, about capacity: infermesh TTFT p90 ÷ direct round robin's", "≤ 0.33×", peers, meshOne, "round-robin", 0.33),
		hitRow("routing, about capacity: infermesh prefix hit ratio ÷ oracle's", "≥ 0.9×", meshOne, 0.9),
	}
	{
		target, goal := "routing, 1.3× capacity: infermesh output tokens/s ÷ oracle's", "≥ 0.95×"
		im, or := at(peers, meshOne, over), at(peers, "oracle", over)
		if im == nil || or == nil || or.TokPerSec <= 0 {
			rows = append(rows, notMeasured(target, goal, "no infermesh and oracle runs at 1.3× capacity"))
		} else {
			q := im.TokPerSec / or.TokPerSec
			rows = append(rows, TargetCheck{target, fmt.Sprintf("%.2f× (%s vs %s)", q, thousands(im.TokPerSec), thousands(or.TokPerSec)), goal, yes(q >= 0.95)})
		}
	}
	{
		target, goal := "routing, 1.3× capacity: infermesh's errors but 503 with Retry-After", "none"
		if im := at(peers, meshOne, over); im == nil {
			rows = append(rows, notMeasured(target, goal, "no infermesh run at 1.3× capacity"))
		} else {
			other := 0
			var parts []string
			for _, k := range slices.Sorted(maps.Keys(im.Errors)) {
				parts = append(parts, fmt.Sprintf("%s: %d", k, im.Errors[k]))
				if k != "503 with Retry-After" {
					other += im.Errors[k]
				}
			}
			fig := "no errors"
			if len(parts) > 0 {
				fig = strings.Join(parts, ", ")
			}
			rows = append(rows, TargetCheck{target, fmt.Sprintf("%d of %d requests (%s)", other, im.Sent, fig), goal, yes(other == 0)})
		}
	}
	{
		target, goal := "routing, 1.3× capacity through infermesh: every engine's queue bounded", "longest in the window's second half ≤ first half's + slots"
		if im := at(peers, meshOne, over); im == nil {
			rows = append(rows, notMeasured(target, goal, "no infermesh run at 1.3× capacity"))
		} else {
			ok := true
			var parts []string
			for i := range im.QueueFirst {
				ok = ok && im.QueueSecond[i] <= im.QueueFirst[i]+slots
				parts = append(parts, fmt.Sprintf("%d → %d", im.QueueFirst[i], im.QueueSecond[i]))
			}
			rows = append(rows, TargetCheck{target, strings.Join(parts, ", ") + " (per engine, first → second half)", goal, yes(ok)})
		}
	}
	rows = append(rows,
		ttftRow("routing, busy local instance (the consumer serves too), about capacity: infermesh TTFT p90 ÷ direct oracle's over all four engines", "≤ 1.5×", local, meshOne, "oracle", 1.5),
		hitRow("routing, two consumers sharing the peers, about capacity: prefix hit ratio ÷ oracle's", "≥ 0.85×", meshTwo, 0.85),
		notMeasured("routing decision's own cost: Resolve + scoring, 3 / 64 candidates", "< 2 µs / < 20 µs", "a Go benchmark of the decision, not this harness's"),
	)
	{
		target, goal := "local path instructions per request ÷ the build before (BENCH_COMPARE, callgrind, one candidate)", "≤ 1.05×"
		now, before := r.instrPer("infermesh"), r.instrPer("infermesh-before")
		if now == 0 || before == 0 {
			rows = append(rows, notMeasured(target, goal, "needs BENCH_COMPARE=<the build before the routing change>"))
		} else {
			q := now / before
			rows = append(rows, TargetCheck{target, fmt.Sprintf("%.3f× (%s vs %s)", q, thousands(now), thousands(before)), goal, yes(q <= 1.05)})
		}
	}
	return rows
}

// markdown writes the routing section.
func (rr *RoutingResults) markdown(w func(string, ...any)) {
	e := rr.Engine
	p := rr.Params
	w("\n## Routing: where requests go\n\n")
	w("Workload (the load generator's, seeded): %s; every request streams.\n\n", rr.WorkloadDesc)
	w("Engines: the demo model in engine mode, %d slots each (FIFO queue behind them), prefill %s per uncached prompt token, decode %s per token, a prefix cache of %s tokens in blocks of %d (LRU), vLLM's metrics. %s\n\n",
		e.Slots, e.PrefillPerToken, e.DecodePerToken, thousands(float64(e.CacheTokens)), e.CacheBlock, e.Scale)
	w("Each topology's *capacity* is measured first: the workload in a closed loop, one client per slot, each request to the engine with the fewest outstanding, so every slot is always busy and the placement is blind to the cache: what a plain load balancer gets out of these engines (completed requests per second over %v after %v). ", p.CapWindow, p.CapWarmup)
	if p.Best {
		w("The same loop with each engine serving its own equal share of the tenants (tenant t on engine t mod n, every prefix warm) gives the *best placement*'s throughput: the most placement can win. ")
	}
	w("Then every row runs at each rate (open loop: Poisson arrivals at that fraction of capacity, every request at its time whatever the others do): the engines' caches are emptied, %v of arrivals at %g× capacity warm them up and are drained, then the measured window of %v, then its drain (at most %v; what is still running then is cut and counted unfinished). Rows at one rate run one after the other and get the same requests at the same times.\n\n",
		p.Warmup, p.WarmupFactor, p.Window, p.Drain)
	w("Rows: *round-robin*, *least-outstanding* and *oracle* are the load generator routing by itself, straight to the engines: what a plain load balancer achieves, and what a router that sees every request achieves. The oracle places each tenant by rendezvous hashing bounded by load (it knows the tenants and their shares: a tenant takes the first engine in its rendezvous order whose share stays within the fair one) and sends a request elsewhere, to the least loaded engine, only when the affine one has more than 2 × %d outstanding. *%s* sends everything to one consumer agent's loopback port, *%s* alternates between two consumers; where a request goes from there is infermesh's decision.\n\n", e.Slots, meshOne, meshTwo)
	w("How to read a table: TTFT and end-to-end are from each request's scheduled arrival (a queue before the engine counts); output tokens/s are those received during the window ÷ the window (below capacity every row gets about the same; above it, what the placement gets done); the hit ratio is the engines' own cached ÷ prompt tokens (vllm:prefix_cache_hits_total ÷ prefix_cache_queries_total) over the run, at most %.3f here (a request's last, partial block and its query are never cached); share is each engine's part of the requests; the longest queue is the most requests waiting for a slot at one engine, in the window's first half → second half (sampled every %v: a queue that keeps growing is a placement that overloads an engine); late is how far behind its schedule the load generator sent (its own lateness: small against the TTFTs, or the figures are the generator's).\n\n",
		rr.ceiling(), p.SampleEvery)
	w("The load generator used %.1f s of CPU over the phase's %.0f s.\n", rr.CPUSeconds, rr.WallSeconds)
	for _, t := range rr.Topologies {
		w("\n### %s: %s\n\n", t.Name, t.Desc)
		c := t.Capacity
		w("Capacity: **%.1f requests/s** (hit ratio %.2f, TTFT p50 %.0f ms, end-to-end p50 %.0f ms; %d errors)", c.RPS, c.HitRatio, c.TTFTP50, c.E2EP50, c.Errors)
		if b := t.Best; b.RPS > 0 {
			w("; with the best placement %.1f requests/s (%.2f× that; hit ratio %.2f, end-to-end p50 %.0f ms)", b.RPS, b.RPS/c.RPS, b.HitRatio, b.E2EP50)
		}
		var split []string
		for i, n := range t.Affinity {
			split = append(split, fmt.Sprintf("%s %d", t.Engines[i], n))
		}
		w(". The oracle's tenants per engine: %s.\n", strings.Join(split, ", "))
		var factors []float64
		for _, r := range t.Runs {
			if !slices.Contains(factors, r.Factor) {
				factors = append(factors, r.Factor)
			}
		}
		for _, f := range factors {
			var runs []RunResult
			for _, r := range t.Runs {
				if r.Factor == f {
					runs = append(runs, r)
				}
			}
			w("\n#### %g× capacity: %.1f requests/s offered for %v\n\n", f, runs[0].Rate, p.Window)
			w("| row | sent | ok | TTFT p50 / p90 / p99 (ms) | end-to-end p50 / p90 (ms) | output tokens/s | hit ratio | share %s | longest queue | errors | late p99 / max (ms) |\n",
				strings.Join(t.Engines, " / "))
			w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
			for _, r := range runs {
				var share []string
				for _, s := range r.Share {
					share = append(share, fmt.Sprintf("%.2f", s))
				}
				w("| %s | %d | %d | %s / %s / %s | %s / %s | %s | %.2f | %s | %s | %s | %.1f / %.1f |\n",
					r.Row, r.Sent, r.OK, thousands(r.TTFT50), thousands(r.TTFT90), thousands(r.TTFT99),
					thousands(r.E2E50), thousands(r.E2E90), thousands(r.TokPerSec), r.HitRatio,
					strings.Join(share, " / "), queueCell(&r, t.Engines), errorsCell(r.Errors), r.Late99, r.LateMax)
			}
		}
	}
	if len(rr.Phases) > 0 {
		var ps []string
		for _, ph := range rr.Phases {
			ps = append(ps, fmt.Sprintf("%s %s", ph.Name, fmtSeconds(ph.Seconds)))
		}
		w("\nRouting phases: %s.\n", strings.Join(ps, "; "))
	}
}

// ceiling is the best hit ratio the workload allows: a request's leading
// full blocks of the system prompt (and, multi-turn, of its history) out
// of its tokens; for one turn, the system prompt's full blocks ÷ the
// prompt.
func (rr *RoutingResults) ceiling() float64 {
	w, b := rr.Workload, rr.Engine.CacheBlock
	if b <= 0 {
		return 0
	}
	prompt := w.SystemTokens + w.QueryTokens
	return float64(w.SystemTokens/b*b) / float64(prompt)
}

// queueCell is the longest queue of the engine that had it: in the
// window's first half → its second half.
func queueCell(r *RunResult, engines []string) string {
	at, longest := -1, 0
	for i := range r.QueueFirst {
		if m := max(r.QueueFirst[i], r.QueueSecond[i]); at < 0 || m > longest {
			at, longest = i, m
		}
	}
	if at < 0 || longest == 0 {
		return "0"
	}
	if at >= len(engines) {
		return fmt.Sprintf("%d → %d", r.QueueFirst[at], r.QueueSecond[at])
	}
	return fmt.Sprintf("%d → %d (%s)", r.QueueFirst[at], r.QueueSecond[at], engines[at])
}

func errorsCell(errs map[string]int) string {
	if len(errs) == 0 {
		return "0"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(errs)) {
		parts = append(parts, fmt.Sprintf("%s: %d", k, errs[k]))
	}
	return strings.Join(parts, ", ")
}
