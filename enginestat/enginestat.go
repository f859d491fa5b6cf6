// Package enginestat reads an inference server's own account of its
// capacity and load: llama.cpp's llama-server (its /metrics, names
// llamacpp:..., and /slots) and vLLM (/metrics, names vllm:...). It is
// pure: the agent fetches, this package parses, and the result is a
// placement.Capacity the agent advertises.
//
// The names, as the servers export them:
//
//	llama-server               vLLM                        meaning
//	llamacpp:requests_processing  vllm:num_requests_running  requests in a slot now
//	llamacpp:requests_deferred    vllm:num_requests_waiting  requests waiting for one
//	llamacpp:kv_cache_usage_ratio vllm:kv_cache_usage_perc   KV cache in use, 0 to 1
//	                              (vllm:gpu_cache_usage_perc, before 0.10)
//	/slots: one entry per slot    -                          how many run at once
//
// vLLM exports its gauges once per model and engine (labels model_name,
// engine): they are summed. vLLM has no slot count; the role's capacity
// (config) gives it.
package enginestat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Modes of a role's metrics setting.
const (
	Auto     = "auto"     // find out from the names the server exports
	LlamaCpp = "llamacpp" // llama.cpp's llama-server
	VLLM     = "vllm"
	None     = "none" // the server exports none: the agent's own count stands in
)

// ValidMode reports whether m is a metrics setting ("" is Auto).
func ValidMode(m string) bool {
	switch m {
	case "", Auto, LlamaCpp, VLLM, None:
		return true
	}
	return false
}

// Stats is what one /metrics answer says.
type Stats struct {
	Engine           string // LlamaCpp or VLLM
	Running, Waiting float64
	KVUsage          float64 // 0 to 1
	HasKV            bool
	// CacheTokens is the tokens the KV cache holds: vLLM's
	// vllm:cache_config_info labels num_gpu_blocks × block_size; 0 when
	// not said.
	CacheTokens float64
	// PrefixQueries and PrefixHits are vLLM's prefix cache counters, in
	// tokens (vllm:prefix_cache_queries_total and _hits_total: the prompt
	// tokens looked up and those found); HasPrefix when both are there.
	// llama.cpp exports none.
	PrefixQueries, PrefixHits float64
	HasPrefix                 bool
}

// names per engine: running, waiting, then the KV cache gauges in order
// of preference.
var names = map[string][3][]string{
	LlamaCpp: {{"llamacpp:requests_processing"}, {"llamacpp:requests_deferred"}, {"llamacpp:kv_cache_usage_ratio"}},
	VLLM:     {{"vllm:num_requests_running"}, {"vllm:num_requests_waiting"}, {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}},
}

// ErrUnknownEngine is Parse's answer in Auto mode to metrics of neither
// engine.
var ErrUnknownEngine = errors.New("the metrics are neither llama.cpp's (llamacpp:...) nor vLLM's (vllm:...)")

// Parse reads a /metrics answer (Prometheus' text format) of the engine
// mode names (Auto: whichever's names it holds).
func Parse(text []byte, mode string) (Stats, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		return Stats{}, fmt.Errorf("the instance's metrics: %w", err)
	}
	engine := mode
	if mode == "" || mode == Auto {
		switch {
		case fams[names[LlamaCpp][0][0]] != nil:
			engine = LlamaCpp
		case fams[names[VLLM][0][0]] != nil:
			engine = VLLM
		default:
			return Stats{}, ErrUnknownEngine
		}
	}
	n, ok := names[engine]
	if !ok {
		return Stats{}, fmt.Errorf("metrics mode %q is not an engine", mode)
	}
	running, ok := sum(fams, n[0][0])
	if !ok {
		return Stats{}, fmt.Errorf("the instance's metrics have no %s", n[0][0])
	}
	waiting, _ := sum(fams, n[1][0])
	st := Stats{Engine: engine, Running: count(running), Waiting: count(waiting)}
	for _, name := range n[2] {
		if kv, ok := sum(fams, name); ok {
			st.KVUsage, st.HasKV = min(max(kv, 0), 1), true
			break
		}
	}
	if engine == VLLM {
		st.CacheTokens = vllmCacheTokens(fams["vllm:cache_config_info"])
		// vLLM v1's names, then v0's.
		for _, n := range [][2]string{{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}, {"vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"}} {
			q, okQ := sum(fams, n[0])
			h, okH := sum(fams, n[1])
			if okQ && okH && q >= 0 && h >= 0 {
				st.PrefixQueries, st.PrefixHits, st.HasPrefix = q, min(h, q), true
				break
			}
		}
	}
	return st, nil
}

// vllmCacheTokens reads vLLM's cache_config_info (an info gauge whose
// labels are the cache's config): num_gpu_blocks × block_size, bounded to
// 32 bits; 0 when either is absent or not a count.
func vllmCacheTokens(f *dto.MetricFamily) float64 {
	if f == nil || len(f.GetMetric()) == 0 {
		return 0
	}
	var blocks, size uint64
	var errB, errS error = strconv.ErrSyntax, strconv.ErrSyntax
	for _, l := range f.GetMetric()[0].GetLabel() {
		switch l.GetName() {
		case "num_gpu_blocks":
			blocks, errB = strconv.ParseUint(l.GetValue(), 10, 32)
		case "block_size":
			size, errS = strconv.ParseUint(l.GetValue(), 10, 32)
		}
	}
	if errB != nil || errS != nil {
		return 0
	}
	return float64(min(blocks*size, math.MaxUint32))
}

// count is a gauge read as a count: at least 0, at most 2^32-1.
func count(v float64) float64 { return math.Round(min(max(v, 0), math.MaxUint32)) }

// sum adds name's samples (gauges or untyped); false when it is absent.
func sum(fams map[string]*dto.MetricFamily, name string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
	var s float64
	for _, m := range f.GetMetric() {
		var v float64
		switch {
		case m.Gauge != nil:
			v = m.GetGauge().GetValue()
		case m.Counter != nil:
			v = m.GetCounter().GetValue()
		default:
			v = m.GetUntyped().GetValue()
		}
		if !math.IsNaN(v) && !math.IsInf(v, 0) {
			s += v
		}
	}
	return s, true
}

// ParseSlots reads llama-server's /slots answer: a JSON array, one entry
// per slot. It returns how many, and the context they hold together (each
// slot's n_ctx: llama-server divides its context, its KV cache, between
// its slots; 0 when not said), bounded to 32 bits.
func ParseSlots(body []byte) (n int, ctxTokens float64, err error) {
	var slots []struct {
		NCtx float64 `json:"n_ctx"`
	}
	if err := json.Unmarshal(body, &slots); err != nil {
		return 0, 0, fmt.Errorf("the instance's /slots: %w", err)
	}
	for _, s := range slots {
		if s.NCtx > 0 && !math.IsInf(s.NCtx, 0) {
			ctxTokens += math.Floor(s.NCtx)
		}
	}
	return len(slots), min(ctxTokens, math.MaxUint32), nil
}
