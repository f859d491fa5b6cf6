package main

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/infermesh/infermesh/agent/admin"
)

// What `infermesh top` shows, computed from two scrapes of the agent's
// metrics: rates are the difference of the counters over the time between
// them, and the TTFT quantiles come from the difference of the histogram's
// buckets, interpolated within a bucket as Prometheus' histogram_quantile
// does. Pure functions of their input, so a test pins them.

// topSample is one scrape: the counters top reads, summed by the labels it
// shows.
type topSample struct {
	at time.Time
	// requests from this host's apps, by role, then target (local, a peer,
	// none) and whether the status was an error (not 2xx).
	appReqs map[string]map[string]float64
	appErrs map[string]float64
	// peerReqs: requests peers sent here, served by our instance.
	peerReqs map[string]float64
	// tokens: completion tokens of the apps' requests.
	tokens map[string]float64
	// ttft: the apps' streamed requests' TTFT buckets (upper bound to
	// cumulative count), by role.
	ttft    map[string]map[float64]float64
	streams map[string]float64
	// instance: the local instance's capacity gauges by role, then kind
	// (slots, running, waiting); kv its KV cache use.
	instance map[string]map[string]float64
	kv       map[string]float64
}

// parseTopSample reads the counters top shows from a metrics text.
func parseTopSample(text string, at time.Time) (topSample, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		return topSample{}, fmt.Errorf("the agent's metrics: %w", err)
	}
	s := topSample{at: at, appReqs: map[string]map[string]float64{}, appErrs: map[string]float64{},
		peerReqs: map[string]float64{}, tokens: map[string]float64{}, ttft: map[string]map[float64]float64{}, streams: map[string]float64{},
		instance: map[string]map[string]float64{}, kv: map[string]float64{}}
	for _, m := range metricsOf(fams, "infermesh_requests_total") {
		l := labelsOf(m)
		v := valueOf(m)
		switch l["source"] {
		case "app":
			if s.appReqs[l["role"]] == nil {
				s.appReqs[l["role"]] = map[string]float64{}
			}
			s.appReqs[l["role"]][l["target"]] += v
			if !strings.HasPrefix(l["code"], "2") {
				s.appErrs[l["role"]] += v
			}
		case "peer":
			s.peerReqs[l["role"]] += v
		}
	}
	for _, m := range metricsOf(fams, "infermesh_tokens_total") {
		if l := labelsOf(m); l["source"] == "app" && l["kind"] == "completion" {
			s.tokens[l["role"]] += valueOf(m)
		}
	}
	for _, m := range metricsOf(fams, "infermesh_time_to_first_token_seconds") {
		l := labelsOf(m)
		if l["source"] != "app" {
			continue
		}
		if s.ttft[l["role"]] == nil {
			s.ttft[l["role"]] = map[float64]float64{}
		}
		h := m.GetHistogram()
		for _, b := range h.GetBucket() {
			if !math.IsInf(b.GetUpperBound(), 1) {
				s.ttft[l["role"]][b.GetUpperBound()] += float64(b.GetCumulativeCount())
			}
		}
		s.ttft[l["role"]][math.Inf(1)] += float64(h.GetSampleCount())
	}
	for _, m := range metricsOf(fams, "infermesh_active_streams") {
		s.streams[labelsOf(m)["role"]] += valueOf(m)
	}
	for _, m := range metricsOf(fams, "infermesh_instance_capacity") {
		l := labelsOf(m)
		if s.instance[l["role"]] == nil {
			s.instance[l["role"]] = map[string]float64{}
		}
		s.instance[l["role"]][l["kind"]] = valueOf(m)
	}
	for _, m := range metricsOf(fams, "infermesh_instance_kv_cache_usage_ratio") {
		s.kv[labelsOf(m)["role"]] = valueOf(m)
	}
	return s, nil
}

func metricsOf(fams map[string]*dto.MetricFamily, name string) []*dto.Metric {
	if f := fams[name]; f != nil {
		return f.GetMetric()
	}
	return nil
}

// valueOf is a counter's, gauge's or untyped sample's value.
func valueOf(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	}
	return m.GetUntyped().GetValue()
}

func labelsOf(m *dto.Metric) map[string]string {
	out := make(map[string]string, len(m.GetLabel()))
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// topRow is one role's line.
type topRow struct {
	Role           string
	ReqPerSec      float64 // from this host's apps
	ErrPerSec      float64 // of them, not 2xx
	TTFTp50        float64 // seconds; NaN when no stream started
	TTFTp90        float64
	TokensPerSec   float64 // completion tokens
	Streams        float64 // streams in flight now
	PeerReqPerSec  float64 // served here for peers
	Share          []topShare
	ServedRequests float64 // requests in the interval (the share's total)
	// The local instance's capacity now (Local false: none here).
	Local                   bool
	Slots, Running, Waiting float64
	KVUsage                 float64
}

// MarshalJSON writes the row with snake_case names, and the TTFT
// quantiles as null when no stream started (JSON has no NaN).
func (r topRow) MarshalJSON() ([]byte, error) {
	q := func(v float64) *float64 {
		if math.IsNaN(v) {
			return nil
		}
		return &v
	}
	share := r.Share
	if share == nil {
		share = []topShare{}
	}
	return json.Marshal(struct {
		Role          string     `json:"role"`
		ReqPerSec     float64    `json:"requests_per_second"`
		ErrPerSec     float64    `json:"errors_per_second"`
		TTFTp50       *float64   `json:"ttft_p50_seconds"`
		TTFTp90       *float64   `json:"ttft_p90_seconds"`
		TokensPerSec  float64    `json:"completion_tokens_per_second"`
		Streams       float64    `json:"streams"`
		PeerReqPerSec float64    `json:"peer_requests_per_second"`
		Requests      float64    `json:"requests"`
		Share         []topShare `json:"served_by"`
		Instance      any        `json:"local_instance,omitempty"`
	}{r.Role, r.ReqPerSec, r.ErrPerSec, q(r.TTFTp50), q(r.TTFTp90), r.TokensPerSec, r.Streams, r.PeerReqPerSec, r.ServedRequests, share, r.instanceJSON()})
}

func (r topRow) instanceJSON() any {
	if !r.Local {
		return nil
	}
	return struct {
		Slots   float64 `json:"slots"`
		Running float64 `json:"running"`
		Waiting float64 `json:"waiting"`
		KVUsage float64 `json:"kv_usage"`
	}{r.Slots, r.Running, r.Waiting, r.KVUsage}
}

// topShare is the part of a role's requests one target served.
type topShare struct {
	Target   string  `json:"target"`
	Fraction float64 `json:"fraction"`
}

// topRows is what happened between prev and cur, one row per role seen in
// either, sorted by role.
func topRows(prev, cur topSample) []topRow {
	dt := cur.at.Sub(prev.at).Seconds()
	if dt <= 0 {
		dt = 1
	}
	roles := map[string]bool{}
	for _, m := range []map[string]float64{cur.appErrs, cur.peerReqs, cur.tokens, cur.streams} {
		for r := range m {
			roles[r] = true
		}
	}
	for r := range cur.appReqs {
		roles[r] = true
	}
	for r := range cur.instance {
		roles[r] = true
	}
	var out []topRow
	for role := range roles {
		row := topRow{Role: role, Streams: cur.streams[role]}
		total := 0.0
		for target, n := range cur.appReqs[role] {
			d := delta(n, prev.appReqs[role][target])
			total += d
			if d > 0 {
				row.Share = append(row.Share, topShare{Target: target, Fraction: d})
			}
		}
		for i := range row.Share {
			row.Share[i].Fraction /= total
		}
		slices.SortFunc(row.Share, func(a, b topShare) int {
			if a.Fraction != b.Fraction {
				if a.Fraction > b.Fraction {
					return -1
				}
				return 1
			}
			return strings.Compare(a.Target, b.Target)
		})
		row.ServedRequests = total
		row.ReqPerSec = total / dt
		row.ErrPerSec = delta(cur.appErrs[role], prev.appErrs[role]) / dt
		row.TokensPerSec = delta(cur.tokens[role], prev.tokens[role]) / dt
		row.PeerReqPerSec = delta(cur.peerReqs[role], prev.peerReqs[role]) / dt
		buckets := map[float64]float64{}
		for le, n := range cur.ttft[role] {
			buckets[le] = delta(n, prev.ttft[role][le])
		}
		row.TTFTp50, row.TTFTp90 = bucketQuantile(0.5, buckets), bucketQuantile(0.9, buckets)
		if in, ok := cur.instance[role]; ok {
			row.Local = true
			row.Slots, row.Running, row.Waiting, row.KVUsage = in["slots"], in["running"], in["waiting"], cur.kv[role]
		}
		out = append(out, row)
	}
	slices.SortFunc(out, func(a, b topRow) int { return strings.Compare(a.Role, b.Role) })
	return out
}

// delta is cur - prev, or cur when the counter went back (the agent
// restarted between the scrapes).
func delta(cur, prev float64) float64 {
	if cur < prev {
		return cur
	}
	return cur - prev
}

// bucketQuantile is the q-quantile of a histogram given as cumulative
// counts by upper bound (+Inf included), interpolated linearly within the
// bucket it falls in (the lowest bucket from 0); NaN when it is empty. A
// quantile in the +Inf bucket is the highest finite bound.
func bucketQuantile(q float64, buckets map[float64]float64) float64 {
	bounds := make([]float64, 0, len(buckets))
	for le := range buckets {
		bounds = append(bounds, le)
	}
	sort.Float64s(bounds)
	if len(bounds) == 0 {
		return math.NaN()
	}
	total := buckets[bounds[len(bounds)-1]]
	if total <= 0 {
		return math.NaN()
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for _, le := range bounds {
		n := buckets[le]
		if n >= rank {
			if math.IsInf(le, 1) {
				return lower
			}
			if n == below {
				return le
			}
			return lower + (le-lower)*(rank-below)/(n-below)
		}
		lower, below = le, n
	}
	return lower
}

// renderTop is one frame: a header from the status, then a row per role.
func renderTop(st admin.Status, rows []topRow, interval time.Duration, at time.Time) string {
	var b strings.Builder
	mesh := st.Mesh.State
	if st.Mesh.State == "joined" {
		mesh = fmt.Sprintf("joined, %d members (%d admitted)", st.Mesh.Members, st.Mesh.Admitted)
	}
	fmt.Fprintf(&b, "infermesh top: node %s %s, up %s, mesh %s; %s every %s\n\n",
		st.Node, st.Version, roughDuration(time.Duration(st.UptimeSeconds*float64(time.Second))), mesh,
		at.UTC().Format("15:04:05"), interval)
	tbl := [][]string{{"ROLE", "REQ/S", "ERR/S", "TTFT P50", "TTFT P90", "TOK/S", "STREAMS", "PEERS REQ/S", "INSTANCE", "QUEUE", "KV", "SERVED BY"}}
	for _, r := range rows {
		inst, queue, kv := "-", "-", "-"
		if r.Local {
			inst = fmt.Sprintf("%d running", int(r.Running))
			if r.Slots > 0 {
				inst = fmt.Sprintf("%d/%d slots", int(r.Running), int(r.Slots))
			}
			queue = strconv.Itoa(int(r.Waiting))
			kv = fmt.Sprintf("%d%%", int(math.Round(r.KVUsage*100)))
		}
		var share []string
		for _, s := range r.Share {
			share = append(share, fmt.Sprintf("%s %d%%", s.Target, int(math.Round(s.Fraction*100))))
		}
		tbl = append(tbl, []string{
			r.Role, rate(r.ReqPerSec), rate(r.ErrPerSec), seconds(r.TTFTp50), seconds(r.TTFTp90), rate(r.TokensPerSec),
			strconv.Itoa(int(r.Streams)), rate(r.PeerReqPerSec), inst, queue, kv, joinOr(share, "-"),
		})
	}
	if len(rows) == 0 {
		b.WriteString("no requests yet\n")
		return b.String()
	}
	b.WriteString(table(tbl))
	return b.String()
}

func rate(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v < 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
}

func seconds(s float64) string {
	if math.IsNaN(s) {
		return "-"
	}
	return fmtSeconds(s)
}
