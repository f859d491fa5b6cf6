package main

import (
	"slices"
	"strings"
	"testing"
)

func TestContenderPIDs(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    Contender
		want []int
	}{
		{"none", Contender{}, nil},
		{"zero", Contender{PIDs: []int{0}}, nil},
		{"old form", Contender{PID: 7}, []int{7}},
		{"two agents", Contender{PIDs: []int{7, 8}}, []int{7, 8}},
		{"both forms, deduplicated", Contender{PIDs: []int{7, 8}, PID: 8}, []int{7, 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.c.pids(); !slices.Equal(got, tc.want) {
				t.Errorf("pids() = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestRemoteBoundRow(t *testing.T) {
	med := func(v float64) *Stat { return &Stat{Med: v, Min: v, Max: v, N: 1} }
	mk := func(directP50, local, remote float64, h3 *LatFig, note string) (*Report, *ContReport, *ContReport) {
		r := &Report{
			Contenders: []ContReport{
				{Name: "direct", C1: &LatFig{P50: med(directP50)}},
				{Name: "infermesh", C1: &LatFig{P50: med(directP50 + local), AddedP50: med(local)}},
				{Name: quicName, C1: &LatFig{P50: med(directP50 + remote), AddedP50: med(remote)}},
			},
			BareH3: h3, BareH3Note: note,
		}
		return r, &r.Contenders[1], &r.Contenders[2]
	}
	for _, tc := range []struct {
		name                  string
		direct, local, remote float64
		h3                    *LatFig
		note                  string
		wantMet, wantFigure   string
	}{
		// 1.25 * (100 + 60) = 200
		{"met", 100, 100, 200, &LatFig{P50: med(60)}, "", "yes", "1.00× (200 µs vs 1.25 × (100 + 60) = 200 µs)"},
		{"not met", 100, 100, 250, &LatFig{P50: med(60)}, "", "**no**", "1.25× (250 µs"},
		{"no bare exchange", 100, 100, 200, nil, "", "n/a", "-bench RemoteHop ./agent/"},
		{"bare exchange failed", 100, 100, 200, nil, "bare HTTP/3 exchange failed: boom", "n/a", "failed: boom"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, im, q := mk(tc.direct, tc.local, tc.remote, tc.h3, tc.note)
			row := remoteBoundRow(r, im, q)
			if row.Met != tc.wantMet {
				t.Errorf("met %q, want %q (%s)", row.Met, tc.wantMet, row.Figure)
			}
			if !strings.Contains(row.Figure, tc.wantFigure) {
				t.Errorf("figure %q, want it to contain %q", row.Figure, tc.wantFigure)
			}
		})
	}
}

// The summary has every row, in order, whatever was measured: a quick run
// (no 4096 streams, no N=100 mesh) says so rather than dropping rows.
func TestSummaryRows(t *testing.T) {
	med := func(v float64) *Stat { return &Stat{Med: v, Min: v, Max: v, N: 1} }
	want := []string{
		"local c=1 added p99", "local c=1 added p50", "local c=64 req/s", "streaming added TTFT p99",
		"remote hop added p50 ÷ 1.25", "remote c=64 req/s ÷ local", "remote hop vs nginx-tls",
		"remote 4096 concurrent streams", "mesh N=100 real", "mesh N=50 real", "sim N=1000: advert reaches all", "sim N=1000: advert bytes",
		"CPU per request at c=64", "instructions per request",
		"routing, about capacity: infermesh TTFT p90 ÷ direct oracle's", "routing, about capacity: infermesh TTFT p90 ÷ direct round robin's",
		"routing, about capacity: infermesh prefix hit ratio", "routing, 1.3× capacity: infermesh output tokens/s",
		"routing, 1.3× capacity: infermesh's errors", "routing, 1.3× capacity through infermesh: every engine's queue",
		"routing, busy local instance", "routing, two consumers", "routing decision's own cost", "local path instructions per request ÷ the build before",
	}
	t.Run("nothing measured", func(t *testing.T) {
		got := (&Report{Contenders: []ContReport{{Name: "direct"}}}).summary()
		if len(got) != len(want) {
			t.Fatalf("%d rows, want %d: %+v", len(got), len(want), got)
		}
		for i, row := range got {
			if !strings.HasPrefix(row.Target, want[i]) {
				t.Errorf("row %d = %q, want it to start with %q", i, row.Target, want[i])
			}
			if row.Met != "n/a" || row.Goal == "" {
				t.Errorf("row %d (%s): met %q, goal %q; want n/a and a goal", i, row.Target, row.Met, row.Goal)
			}
		}
	})
	t.Run("measured", func(t *testing.T) {
		thr := func(rps, nginx, cpu float64) *ThrFig {
			return &ThrFig{RPS: med(rps), Nginx: med(nginx), CPU: med(cpu), UpstreamCPU: med(10)}
		}
		r := &Report{
			Contenders: []ContReport{
				{Name: "direct", Throughput: &ThrFig{RPS: med(40000), CPU: med(10), UpstreamCPU: med(10)}},
				{Name: "infermesh", C1: &LatFig{AddedP50: med(50), AddedP99: med(100), AddedP50Nginx: 1.25, AddedP99Nginx: 0.9},
					TTFT: &LatFig{AddedP99: med(90), AddedP99Nginx: 0.9}, Throughput: thr(20000, 0.8, 40)},
				{Name: "nginx", C1: &LatFig{AddedP50: med(40), AddedP99: med(111)}, TTFT: &LatFig{AddedP99: med(100)}, Throughput: &ThrFig{RPS: med(25000), CPU: med(30)}},
				{Name: "haproxy", Throughput: thr(27500, 1.1, 28)},
				{Name: quicName, Throughput: thr(13000, 0.52, 120), Many: []manyRes{{Streams: 4096, Completed: 4096, KiBPerStream: 70}}},
				{Name: infoName, Throughput: thr(19000, 0.76, 45)},
			},
			Mesh: []meshRes{{N: 50, Membership: "2.5s", Advert: "300ms"}, {N: 100, Membership: "2.9s", Advert: "1.2s"}},
			Sim:  []simRes{{N: 1000, Advert: "900ms", AdvertQueueMax: 40, AdvertBytesNodeS: 700, LoadChanges: 5, LoadStale: "12s"}},
			Instructions: []instrCount{{Name: "infermesh", Requests: 10, Instructions: 620000}, {Name: "nginx", Requests: 10, Instructions: 250000},
				{Name: infoName, Requests: 10, Instructions: 700000, Logged: 5}},
		}
		rows := r.summary()
		for _, tc := range []struct {
			row           int
			met, inFigure string
		}{
			{0, "yes", "0.90× (100 vs 111 µs)"},
			{1, "**no**", "1.25×"},
			{2, "**no**", "0.80× (20,000 vs 25,000 req/s); haproxy 1.10×"},
			{3, "yes", "0.90×"},
			{5, "yes", "0.65×"},
			{7, "**no**", "70.0 KiB per stream"},
			{8, "**no**", "2.9s; 1.2s"},
			{9, "yes", "2.5s"},
			{10, "yes", "900ms; 0 (max 40)"},
			{11, "yes", "700 (1.66×; 5 load changes; the stalest node 12s behind, 0 with none)"},
			{12, "–", "infermesh 40.0 + 10.0"},
			{12, "–", "the access log (level info, to a file) costs 5.0 µs"},
			{13, "–", "infermesh 62,000 (2.48× nginx)"},
			{13, "–", "the access log (level info, to a file) costs 8,000 per request, 5 lines written for 10 requests (zap's sampler), at most 16,000 per line written"},
		} {
			row := rows[tc.row]
			if row.Met != tc.met || !strings.Contains(row.Figure, tc.inFigure) {
				t.Errorf("row %d (%s) = %q, met %q; want it to contain %q, met %q", tc.row, row.Target, row.Figure, row.Met, tc.inFigure, tc.met)
			}
		}
	})
}
