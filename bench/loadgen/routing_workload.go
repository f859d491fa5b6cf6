package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// The routing benchmark's workload: tenants, each with a fixed system
// prompt, whose requests add a fresh query; popularity uniform or Zipf;
// optionally multi-turn conversations whose later turns repeat the
// history. Everything is seeded: the same seed gives the same requests in
// the same order and, at one rate, the same arrival times, so the rows of
// a run (and runs of two builds) see the same workload.
//
// Sizes are in tokens as the demo model's engine counts them (the
// demomodel package doc: a message's content of n bytes is ceil(n/4)
// tokens), so a 2,000-token system prompt is 8,000 bytes of plain text.

// RoutingWorkload sizes the workload.
type RoutingWorkload struct {
	Tenants      int    `json:"tenants"`
	SystemTokens int    `json:"system_tokens"`
	QueryTokens  int    `json:"query_tokens"`
	OutputTokens int    `json:"output_tokens"` // max_tokens of every request
	Popularity   string `json:"popularity"`    // uniform or zipf
	// ZipfS is the Zipf exponent: tenant k (from 0) is picked with a
	// weight of (k+1)^-s.
	ZipfS float64 `json:"zipf_s,omitempty"`
	// Turns is the turns of a conversation (1: every request is a new
	// one); Sessions is how many conversations are open at once.
	Turns    int    `json:"turns"`
	Sessions int    `json:"sessions,omitempty"`
	Seed     uint64 `json:"seed"`
}

// defaultRoutingWorkload is the workload of the issue that defines the
// benchmark: 16 tenants with 2,000-token system prompts and 100-token
// queries.
func defaultRoutingWorkload() RoutingWorkload {
	return RoutingWorkload{Tenants: 16, SystemTokens: 2000, QueryTokens: 100, OutputTokens: 32, Popularity: "uniform", ZipfS: 1.1, Turns: 1, Sessions: 8, Seed: 1}
}

func (w RoutingWorkload) validate() error {
	switch {
	case w.Tenants < 1:
		return fmt.Errorf("routing workload: tenants %d, want at least 1", w.Tenants)
	case w.SystemTokens < 1 || w.QueryTokens < 1 || w.OutputTokens < 1:
		return fmt.Errorf("routing workload: system, query and output tokens must be at least 1")
	case w.Popularity != "uniform" && w.Popularity != "zipf":
		return fmt.Errorf("routing workload: popularity %q is not uniform or zipf", w.Popularity)
	case w.Popularity == "zipf" && w.ZipfS <= 1:
		return fmt.Errorf("routing workload: zipf_s %g must be above 1", w.ZipfS)
	case w.Turns < 1:
		return fmt.Errorf("routing workload: turns %d, want at least 1", w.Turns)
	case w.Turns > 1 && w.Sessions < 1:
		return fmt.Errorf("routing workload: sessions %d, want at least 1 with turns > 1", w.Sessions)
	}
	return nil
}

// Describe says what the workload is, for the report.
func (w RoutingWorkload) Describe() string {
	pop := "uniform popularity"
	if w.Popularity == "zipf" {
		pop = fmt.Sprintf("Zipf popularity (s = %g)", w.ZipfS)
	}
	turns := "one turn each"
	if w.Turns > 1 {
		turns = fmt.Sprintf("conversations of %d turns (%d open at once; a later turn repeats the history)", w.Turns, w.Sessions)
	}
	return fmt.Sprintf("%d tenants with a %s-token system prompt each, a fresh %d-token query per request, %d output tokens, %s, %s, seed %d",
		w.Tenants, thousands(float64(w.SystemTokens)), w.QueryTokens, w.OutputTokens, pop, turns, w.Seed)
}

// vocabulary is the text's words: plain lowercase ASCII, so the text needs
// no JSON escaping.
var vocabulary = strings.Fields(`prefix cache tenant query answer system prompt model token block slot queue
engine route mesh peer node local remote shared fresh policy budget window report figure measure
affinity rendezvous hash capacity latency throughput decode prefill batch stream event request reply`)

// text returns exactly n bytes of words drawn by r, starting with lead.
func text(r *rand.Rand, lead string, n int) string {
	var b strings.Builder
	b.Grow(n + 16)
	b.WriteString(lead)
	for b.Len() < n {
		b.WriteString(vocabulary[r.IntN(len(vocabulary))])
		b.WriteByte(' ')
	}
	return b.String()[:n]
}

// seeded is a generator for one purpose of the workload.
func seeded(seed uint64, purpose string, n int) *rand.Rand {
	h := uint64(14695981039346656037)
	for _, c := range []byte(purpose) {
		h = (h ^ uint64(c)) * 1099511628211
	}
	return rand.New(rand.NewPCG(seed, h^uint64(n)*0x9E3779B97F4A7C15))
}

// workload makes the requests.
type workload struct {
	w       RoutingWorkload
	systems []string
}

func newWorkload(w RoutingWorkload) (*workload, error) {
	if err := w.validate(); err != nil {
		return nil, err
	}
	wl := &workload{w: w}
	for t := range w.Tenants {
		wl.systems = append(wl.systems, text(seeded(w.Seed, "system", t), fmt.Sprintf("You answer for tenant %02d. ", t), 4*w.SystemTokens))
	}
	return wl, nil
}

// weights are the tenants' shares of the requests.
func (w RoutingWorkload) weights() []float64 {
	out := make([]float64, w.Tenants)
	sum := 0.0
	for t := range out {
		out[t] = 1
		if w.Popularity == "zipf" { // rand.Zipf with v = 1: (1+k)^-s
			out[t] = math.Pow(float64(t+1), -w.ZipfS)
		}
		sum += out[t]
	}
	for t := range out {
		out[t] /= sum
	}
	return out
}

// tenantKey names tenant t, for affinity.
func tenantKey(t int) string { return "tenant-" + strconv.Itoa(t) }

// item is one request of the sequence.
type item struct {
	tenant int
	// turns holds the query numbers of the conversation so far; the last
	// is this request's.
	turns []int
}

// sequence yields the workload's requests in order.
type sequence struct {
	wl       *workload
	pick     *rand.Rand
	zipf     *rand.Zipf
	n        int
	sessions []item
}

// sequence starts the requests of stream (0 for a warm-up, 1 for the
// measured window, ...): the same stream is the same requests.
func (wl *workload) sequence(stream int) *sequence {
	s := &sequence{wl: wl, pick: seeded(wl.w.Seed, "pick", stream)}
	if wl.w.Popularity == "zipf" {
		s.zipf = rand.NewZipf(rand.New(rand.NewPCG(wl.w.Seed, uint64(stream))), wl.w.ZipfS, 1, uint64(wl.w.Tenants-1))
	}
	if wl.w.Turns > 1 {
		s.sessions = make([]item, wl.w.Sessions)
	}
	return s
}

// tenant picks a tenant by popularity.
func (s *sequence) tenant() int {
	if s.zipf != nil {
		return int(s.zipf.Uint64())
	}
	return s.pick.IntN(s.wl.w.Tenants)
}

// next returns the next request. Query numbers are unique within the
// sequence, so every query is fresh.
func (s *sequence) next() item {
	q := s.n
	s.n++
	if s.sessions == nil {
		return item{tenant: s.tenant(), turns: []int{q}}
	}
	sess := &s.sessions[q%len(s.sessions)]
	if len(sess.turns) == 0 || len(sess.turns) == s.wl.w.Turns {
		*sess = item{tenant: s.tenant()}
	}
	sess.turns = append(sess.turns[:len(sess.turns):len(sess.turns)], q)
	return *sess
}

// body is the request for it: streaming, with max_tokens, asking for
// model.
func (wl *workload) body(it item, stream int, model string) []byte {
	var b strings.Builder
	b.Grow(4*(wl.w.SystemTokens+len(it.turns)*(wl.w.QueryTokens+wl.w.OutputTokens)) + 256)
	b.WriteString(`{"model":`)
	b.WriteString(strconv.Quote(model))
	b.WriteString(`,"stream":true,"max_tokens":`)
	b.WriteString(strconv.Itoa(wl.w.OutputTokens))
	b.WriteString(`,"messages":[{"role":"system","content":"`)
	b.WriteString(wl.systems[it.tenant])
	for i, q := range it.turns {
		if i > 0 { // the answer to the turn before, as the client kept it
			b.WriteString(`"},{"role":"assistant","content":"`)
			b.WriteString(text(seeded(wl.w.Seed, "answer", stream<<32|it.turns[i-1]), "", 4*wl.w.OutputTokens))
		}
		b.WriteString(`"},{"role":"user","content":"`)
		b.WriteString(text(seeded(wl.w.Seed, "query", stream<<32|q), "", 4*wl.w.QueryTokens))
	}
	b.WriteString(`"}]}`)
	return []byte(b.String())
}

// arrivals are the offsets of a Poisson process of rate per second over
// d, seeded: the same rate and seed give the same times.
func arrivals(seed uint64, stream int, rate float64, d time.Duration) []time.Duration {
	r := seeded(seed, "arrivals", stream)
	var out []time.Duration
	for t := 0.0; ; {
		t += r.ExpFloat64() / rate
		at := time.Duration(t * float64(time.Second))
		if at >= d || math.IsInf(t, 0) {
			return out
		}
		out = append(out, at)
	}
}
