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

func TestRemoteTargets(t *testing.T) {
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
		wantMet               []string
		wantFigure            []string
	}{
		// bound = 2*100 + 100 = 300; PERFORMANCE.md: 1.25 * (100 + 60) = 200
		{"both met", 100, 100, 200, &LatFig{P50: med(60)}, "", []string{"yes", "yes"}, []string{"200 µs vs 2 × 100 + 100 = 300 µs", "200 µs vs 1.25 × (100 + 60) = 200 µs"}},
		{"issue's met, PERFORMANCE.md's not", 100, 100, 250, &LatFig{P50: med(60)}, "", []string{"yes", "**no**"}, []string{"= 300 µs", "= 200 µs"}},
		{"neither", 100, 100, 301, &LatFig{P50: med(60)}, "", []string{"**no**", "**no**"}, []string{"301 µs", "301 µs"}},
		{"no bare exchange", 100, 100, 200, nil, "", []string{"yes", "n/a"}, []string{"= 300 µs", "-bench RemoteHop ./agent/"}},
		{"bare exchange failed", 100, 100, 200, nil, "bare HTTP/3 exchange failed: boom", []string{"yes", "n/a"}, []string{"= 300 µs", "failed: boom"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, im, q := mk(tc.direct, tc.local, tc.remote, tc.h3, tc.note)
			got := remoteTargets(r, im, q)
			if len(got) != 2 {
				t.Fatalf("got %d rows, want 2: %+v", len(got), got)
			}
			for i, row := range got {
				if row.Met != tc.wantMet[i] {
					t.Errorf("row %d (%s): met %q, want %q", i, row.Figure, row.Met, tc.wantMet[i])
				}
				if !strings.Contains(row.Figure, tc.wantFigure[i]) {
					t.Errorf("row %d: figure %q, want it to contain %q", i, row.Figure, tc.wantFigure[i])
				}
			}
		})
	}
}
