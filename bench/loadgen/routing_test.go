package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
)

// The workload's prompts are exactly the sizes it names, by the engine's
// own count, and a tenant's second request finds its system prompt cached.
func TestWorkloadTokensByTheEngine(t *testing.T) {
	w := defaultRoutingWorkload()
	wl, err := newWorkload(w)
	if err != nil {
		t.Fatal(err)
	}
	base, stop, err := demomodel.ServeLoopback(demomodel.Config{Parallel: 1, Tokens: 1, CacheTokens: 1 << 16, CacheBlock: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	send := func(it item) (prompt, cached int) {
		t.Helper()
		// Asked without streaming, so that usage comes in the answer.
		body := []byte(strings.Replace(string(wl.body(it, 1, "demo")), `"stream":true`, `"stream":false`, 1))
		if !json.Valid(body) {
			t.Fatalf("body is not JSON: %.200s", body)
		}
		resp, err := http.Post(base+chatPath, "application/json", strings.NewReader(string(body)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(b), "\n") {
			var u struct {
				Usage *struct {
					Prompt  int `json:"prompt_tokens"`
					Details struct {
						Cached int `json:"cached_tokens"`
					} `json:"prompt_tokens_details"`
				} `json:"usage"`
			}
			if json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &u) == nil && u.Usage != nil {
				return u.Usage.Prompt, u.Usage.Details.Cached
			}
		}
		t.Fatalf("no usage in %s", b)
		return 0, 0
	}
	seq := wl.sequence(1)
	first := seq.next()
	if p, c := send(first); p != 2100 || c != 0 {
		t.Errorf("first request: prompt %d, cached %d; want 2100, 0", p, c)
	}
	// The same tenant, a fresh query: its system prompt's 31 full blocks.
	if p, c := send(item{tenant: first.tenant, turns: []int{999}}); p != 2100 || c != 1984 {
		t.Errorf("same tenant again: prompt %d, cached %d; want 2100, 1984", p, c)
	}
	if got := (&RoutingResults{Workload: w, Engine: EngineSpec{CacheBlock: 64}}).ceiling(); got != 1984.0/2100 {
		t.Errorf("ceiling = %v, want 1984/2100", got)
	}
}

func TestWorkloadSequence(t *testing.T) {
	t.Run("seeded", func(t *testing.T) {
		wl, _ := newWorkload(defaultRoutingWorkload())
		a, b, other := wl.sequence(1), wl.sequence(1), wl.sequence(2)
		var ta, tb, to []int
		for range 200 {
			ta, tb, to = append(ta, a.next().tenant), append(tb, b.next().tenant), append(to, other.next().tenant)
		}
		if !slices.Equal(ta, tb) || slices.Equal(ta, to) {
			t.Errorf("the same stream must give the same tenants, another stream others")
		}
		if string(wl.body(item{tenant: 3, turns: []int{7}}, 1, "m")) != string(wl.body(item{tenant: 3, turns: []int{7}}, 1, "m")) {
			t.Errorf("the same item gave two bodies")
		}
		if string(wl.body(item{tenant: 3, turns: []int{7}}, 1, "m")) == string(wl.body(item{tenant: 3, turns: []int{8}}, 1, "m")) {
			t.Errorf("two queries gave the same body")
		}
	})
	t.Run("zipf", func(t *testing.T) {
		w := defaultRoutingWorkload()
		w.Popularity = "zipf"
		wl, err := newWorkload(w)
		if err != nil {
			t.Fatal(err)
		}
		seq := wl.sequence(1)
		counts := make([]int, w.Tenants)
		for range 4000 {
			counts[seq.next().tenant]++
		}
		if counts[0] <= 2*counts[w.Tenants-1] || counts[0] < 4000/w.Tenants {
			t.Errorf("zipf counts %v: want the first tenant far ahead of the last", counts)
		}
	})
	t.Run("multi-turn", func(t *testing.T) {
		w := defaultRoutingWorkload()
		w.Turns, w.Sessions = 3, 2
		wl, _ := newWorkload(w)
		seq := wl.sequence(1)
		var items []item
		for range 8 {
			items = append(items, seq.next())
		}
		// Sessions alternate: 0, 1, 0, 1, ...; a session's turns grow to
		// 3 and its tenant stays, then a new conversation starts.
		for i, want := range []int{1, 1, 2, 2, 3, 3, 1, 1} {
			if len(items[i].turns) != want {
				t.Errorf("request %d has %d turns, want %d", i, len(items[i].turns), want)
			}
		}
		if items[2].tenant != items[0].tenant || !slices.Equal(items[2].turns[:1], items[0].turns) {
			t.Errorf("turn 2 %+v does not continue turn 1 %+v", items[2], items[0])
		}
		body := string(wl.body(items[4], 1, "m"))
		if !json.Valid([]byte(body)) || strings.Count(body, `"role":"user"`) != 3 || strings.Count(body, `"role":"assistant"`) != 2 {
			t.Errorf("third turn's body has %d user and %d assistant messages, want 3 and 2", strings.Count(body, `"role":"user"`), strings.Count(body, `"role":"assistant"`))
		}
		if !strings.HasPrefix(body, string(wl.body(items[0], 1, "m"))[:4*w.SystemTokens]) {
			t.Errorf("a later turn does not repeat the conversation's start")
		}
	})
	t.Run("invalid", func(t *testing.T) {
		for _, mod := range []func(*RoutingWorkload){
			func(w *RoutingWorkload) { w.Tenants = 0 },
			func(w *RoutingWorkload) { w.Popularity = "pareto" },
			func(w *RoutingWorkload) { w.Popularity, w.ZipfS = "zipf", 1 },
			func(w *RoutingWorkload) { w.Turns = 0 },
		} {
			w := defaultRoutingWorkload()
			mod(&w)
			if _, err := newWorkload(w); err == nil {
				t.Errorf("newWorkload(%+v) succeeded, want an error", w)
			}
		}
	})
}

func TestArrivals(t *testing.T) {
	a := arrivals(1, 1, 100, 10*time.Second)
	if n := len(a); n < 800 || n > 1200 {
		t.Errorf("%d arrivals at 100/s over 10 s, want about 1000", n)
	}
	if !slices.IsSorted(a) || a[len(a)-1] >= 10*time.Second {
		t.Errorf("arrivals not sorted within the window")
	}
	if !slices.Equal(a, arrivals(1, 1, 100, 10*time.Second)) || slices.Equal(a, arrivals(1, 2, 100, 10*time.Second)) {
		t.Errorf("the same seed and stream must give the same times, another stream others")
	}
}

func TestRendezvous(t *testing.T) {
	names := []string{"b", "c", "d"}
	moved := 0
	for k := range 1000 {
		key := fmt.Sprint("tenant-", k)
		i := rendezvous(key, names)
		if rendezvous(key, names) != i {
			t.Fatalf("%s: two answers", key)
		}
		// Without c, only c's keys move.
		j := rendezvous(key, []string{"b", "d"})
		if names[i] != "c" && []string{"b", "d"}[j] != names[i] {
			t.Fatalf("%s moved from %s although c left", key, names[i])
		}
		if names[i] == "c" {
			moved++
		}
	}
	if moved < 200 || moved > 470 {
		t.Errorf("c had %d of 1000 keys, want about a third", moved)
	}
}

// The oracle's placement: rendezvous order, bounded by load, the same for
// every chooser.
func TestAffinity(t *testing.T) {
	for _, tc := range []struct {
		names []string
		pop   string
		// wantTenants are the tenants per engine, sorted (uniform);
		// maxLoad the largest share any engine may get.
		wantTenants []int
		maxLoad     float64
	}{
		{[]string{"b", "c", "d"}, "uniform", []int{5, 5, 6}, 6.0 / 16},
		{[]string{"f", "b", "c", "d"}, "uniform", []int{4, 4, 4, 4}, 4.0 / 16},
		{[]string{"b", "c", "d"}, "zipf", nil, 0.4},
	} {
		w := defaultRoutingWorkload()
		w.Popularity = tc.pop
		weights := w.weights()
		got := affinity(tc.names, weights)
		if !slices.Equal(got, affinity(tc.names, weights)) {
			t.Fatalf("%v: two placements", tc.names)
		}
		load := make([]float64, len(tc.names))
		tenants := make([]int, len(tc.names))
		for tn, e := range got {
			load[e] += weights[tn]
			tenants[e]++
		}
		slices.Sort(tenants)
		if tc.wantTenants != nil && !slices.Equal(tenants, tc.wantTenants) {
			t.Errorf("%v %s: tenants per engine %v, want %v", tc.names, tc.pop, tenants, tc.wantTenants)
		}
		if m := slices.Max(load); m > tc.maxLoad+1e-9 {
			t.Errorf("%v %s: loads %v, the largest over %.3f", tc.names, tc.pop, load, tc.maxLoad)
		}
		// With equal tenants, most keep their first rendezvous choice.
		if tc.pop != "uniform" {
			continue
		}
		moved := 0
		for tn, e := range got {
			if e != rendezvous(tenantKey(tn), tc.names) {
				moved++
			}
		}
		if moved > len(got)/2 {
			t.Errorf("%v %s: %d of %d tenants off their first rendezvous choice", tc.names, tc.pop, moved, len(got))
		}
	}
	var sum float64
	for _, w := range defaultRoutingWorkload().weights() {
		sum += w
	}
	if sum < 0.999 || sum > 1.001 {
		t.Errorf("weights add up to %v", sum)
	}
}

func TestPicker(t *testing.T) {
	names := []string{"b", "c", "d"}
	t.Run("round robin", func(t *testing.T) {
		p := newPicker(policyRoundRobin, names, 4, nil)
		var got []int
		for range 6 {
			got = append(got, p.pick(0))
		}
		if !slices.Equal(got, []int{0, 1, 2, 0, 1, 2}) {
			t.Errorf("picks %v", got)
		}
	})
	t.Run("least outstanding", func(t *testing.T) {
		p := newPicker(policyLeast, names, 4, nil)
		p.outstanding[0].Store(3)
		p.outstanding[2].Store(1)
		if i := p.pick(0); i != 1 {
			t.Errorf("pick %d, want 1 (none outstanding)", i)
		}
		if i := p.pick(0); i != 1 && i != 2 {
			t.Errorf("pick %d, want 1 or 2 (one outstanding each)", i)
		}
	})
	t.Run("oracle", func(t *testing.T) {
		weights := defaultRoutingWorkload().weights()
		p := newPicker(policyOracle, names, 4, weights)
		aff := affinity(names, weights)[5]
		for range 9 { // up to 2 × slots + 1 outstanding at the affine engine
			if i := p.pick(5); i != aff {
				t.Fatalf("pick %d with %d outstanding at the affine %d", i, p.outstanding[aff].Load()-1, aff)
			}
		}
		if i := p.pick(5); i == aff {
			t.Errorf("pick %d: the affine engine has %d outstanding (> 2 × 4), want the least loaded", i, p.outstanding[aff].Load())
		}
		p.done(aff)
		p.done(aff)
		if i := p.pick(5); i != aff {
			t.Errorf("pick %d, want the affine %d again at 8 outstanding", i, aff)
		}
	})
}

// routingFixture is routing results whose infermesh rows are given.
func routingFixture(im1, im13, local RunResult) *Report {
	run := func(row string, f, ttft90, hit, tok float64) RunResult {
		return RunResult{Row: row, Factor: f, TTFT90: ttft90, HitRatio: hit, TokPerSec: tok, Sent: 100,
			QueueFirst: []int{1, 1, 1}, QueueSecond: []int{2, 2, 2}}
	}
	im1.Row, im1.Factor = meshOne, 1
	im13.Row, im13.Factor = meshOne, 1.3
	local.Row, local.Factor = meshOne, 1
	two := run(meshTwo, 1, 500, 0.8, 1000)
	return &Report{Routing: &RoutingResults{Engine: EngineSpec{Slots: 4}, Topologies: []TopologyResult{
		{Name: routingPeers, Engines: []string{"b", "c", "d"}, Runs: []RunResult{
			run("round-robin", 1, 3000, 0.4, 900), run("oracle", 1, 400, 0.9, 1000), im1, two,
			run("oracle", 1.3, 2000, 0.8, 1200), im13,
		}},
		{Name: routingLocal, Engines: []string{"f", "b", "c", "d"}, Runs: []RunResult{run("oracle", 1, 500, 0.9, 1000), local}},
	}}}
}

func TestRoutingRows(t *testing.T) {
	good := RunResult{TTFT90: 440, HitRatio: 0.85, TokPerSec: 1150, Sent: 130,
		Errors: map[string]int{"503 with Retry-After": 7}, QueueFirst: []int{4, 5, 4}, QueueSecond: []int{6, 5, 8}}
	bad := RunResult{TTFT90: 1200, HitRatio: 0.5, TokPerSec: 900, Sent: 130,
		Errors: map[string]int{"502": 2, "503 with Retry-After": 1}, QueueFirst: []int{4, 5, 4}, QueueSecond: []int{20, 5, 8}}
	badTwo := routingFixture(bad, bad, RunResult{TTFT90: 5000})
	badTwo.Routing.Topologies[0].Runs[3].HitRatio = 0.5
	for _, tc := range []struct {
		name string
		r    *Report
		met  []string // rows 0-7
		in   map[int]string
	}{
		{"met", routingFixture(good, good, RunResult{TTFT90: 700}),
			[]string{"yes", "yes", "yes", "yes", "yes", "yes", "yes", "yes"},
			map[int]string{0: "1.10× (440 vs 400 ms)", 1: "0.15×", 2: "0.94× (0.85 vs 0.90)", 3: "0.96×", 4: "0 of 130", 5: "4 → 6, 5 → 5, 4 → 8", 6: "1.40×", 7: "0.89×"}},
		{"not met", badTwo,
			[]string{"**no**", "**no**", "**no**", "**no**", "**no**", "**no**", "**no**", "**no**"},
			map[int]string{0: "3.00×", 1: "0.40×", 2: "0.56×", 3: "0.75×", 4: "2 of 130 requests (502: 2, 503 with Retry-After: 1)", 5: "4 → 20", 6: "10.00×", 7: "0.56×"}},
		{"not run", &Report{Routing: &RoutingResults{}},
			[]string{"n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := tc.r.routingRows()
			for i, met := range tc.met {
				if rows[i].Met != met {
					t.Errorf("row %d (%s) = %q: met %q, want %q", i, rows[i].Target, rows[i].Figure, rows[i].Met, met)
				}
			}
			for i, fig := range tc.in {
				if !strings.Contains(rows[i].Figure, fig) {
					t.Errorf("row %d (%s) figure %q, want it to contain %q", i, rows[i].Target, rows[i].Figure, fig)
				}
			}
			md := strings.Builder{}
			tc.r.Routing.markdown(func(f string, a ...any) { fmt.Fprintf(&md, f, a...) })
			if len(tc.r.Routing.Topologies) > 0 && !strings.Contains(md.String(), "### peers") {
				t.Errorf("markdown lacks the peers topology")
			}
		})
	}
}

// The whole phase against real engines on loopback, tiny: every row runs,
// every request completes, and the figures come from the engines'
// counters. (The "mesh" row points at an engine itself: the harness only
// knows addresses.) No speed is asserted.
func TestRoutingPhase(t *testing.T) {
	cfg := demomodel.Config{Parallel: 2, Tokens: 4, PrefillPerToken: 10 * time.Microsecond, DecodePerToken: time.Millisecond,
		CacheTokens: 4096, CacheBlock: 16, Metrics: demomodel.MetricsVLLM}
	var engines []RoutingEngine
	for _, name := range []string{"x", "y"} {
		base, stop, err := demomodel.ServeLoopback(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		engines = append(engines, RoutingEngine{Name: name, Addr: strings.TrimPrefix(base, "http://")})
	}
	spec := RoutingSpec{
		Engine: EngineSpec{Slots: 2, CacheBlock: 16, Model: "demo"},
		Topologies: []RoutingTopology{{Name: routingPeers, Engines: engines,
			Mesh: []MeshRow{{Name: meshOne, Addrs: []string{engines[1].Addr}, Model: "demo"}}}},
	}
	if err := checkRoutingSpec(spec); err != nil {
		t.Fatal(err)
	}
	w := RoutingWorkload{Tenants: 4, SystemTokens: 64, QueryTokens: 8, OutputTokens: 4, Popularity: "uniform", Turns: 1, Seed: 3}
	p := RoutingParams{Rates: []float64{0.5}, Window: 1200 * time.Millisecond, Warmup: 100 * time.Millisecond, WarmupFactor: 0.5,
		CapWarmup: 100 * time.Millisecond, CapWindow: 300 * time.Millisecond, Drain: 30 * time.Second, SampleEvery: 20 * time.Millisecond}
	res, err := runRouting(t.Context(), spec, w, p)
	if err != nil {
		t.Fatal(err)
	}
	tr := res.topology(routingPeers)
	if tr == nil || tr.Capacity.RPS <= 0 || tr.Capacity.Errors != 0 {
		t.Fatalf("capacity %+v", tr)
	}
	var rows []string
	for _, r := range tr.Runs {
		rows = append(rows, r.Row)
		if r.Sent == 0 || r.OK != r.Sent || r.Failed() != 0 {
			t.Errorf("%s: sent %d, ok %d, errors %v; want every request answered", r.Row, r.Sent, r.OK, r.Errors)
		}
		sum := 0.0
		for _, s := range r.Share {
			sum += s
		}
		if len(r.Share) != 2 || sum < 0.999 || sum > 1.001 {
			t.Errorf("%s: share %v, want two parts adding up to 1", r.Row, r.Share)
		}
		if r.HitRatio < 0 || r.HitRatio > 1 || r.TTFT50 <= 0 || r.TTFT50 > r.TTFT99 || r.E2E50 < r.TTFT50 {
			t.Errorf("%s: hit %v, TTFT %v/%v, e2e %v", r.Row, r.HitRatio, r.TTFT50, r.TTFT99, r.E2E50)
		}
	}
	if !slices.Equal(rows, []string{"round-robin", "least-outstanding", "oracle", meshOne}) {
		t.Errorf("rows %v", rows)
	}
	// The mesh row sent everything to engine y.
	if r := tr.run(meshOne, 0.5); r == nil || r.Share[1] != 1 {
		t.Errorf("mesh row share %v, want all on y", r.Share)
	}
	// With 4 tenants on engines of room for all, the oracle's affinity
	// finds each tenant's prefix after its first request.
	// finds each tenant's prefix after its first request: with more
	// requests in the window than tenants, one tenant came again (the
	// window is long enough for that at the rate the capacity gives).
	if r := tr.run("oracle", 0.5); r.Sent <= w.Tenants {
		t.Errorf("oracle sent %d requests in the window, want more than the %d tenants", r.Sent, w.Tenants)
	} else if r.HitRatio <= 0 {
		t.Errorf("oracle hit ratio %v over %d requests of %d tenants, want above 0", r.HitRatio, r.Sent, w.Tenants)
	}
}
