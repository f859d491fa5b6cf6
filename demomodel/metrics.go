package demomodel

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// This file serves the engine's own endpoints: GET /metrics in llama.cpp's
// or vLLM's names, GET /slots in llama-server's shape, and POST
// /reset_prefix_cache (vLLM's). The package doc says where each name and
// shape comes from.

var (
	hdrPromText = []string{"text/plain; version=0.0.4"}
	// prometheus_client's CONTENT_TYPE_LATEST, what vLLM answers with.
	hdrPromTextUTF8 = []string{"text/plain; version=0.0.4; charset=utf-8"}
)

// serveEngine answers the engine's endpoints; false when the path is not
// one (or not in this configuration).
func (s *Server) serveEngine(w http.ResponseWriter, r *http.Request) bool {
	switch r.URL.Path {
	case "/metrics":
		if s.cfg.Metrics == MetricsNone {
			return false
		}
		if s.requireGet(w, r) {
			s.serveMetrics(w)
		}
	case "/slots":
		if s.cfg.Metrics != MetricsLlamaCpp {
			return false
		}
		if s.requireGet(w, r) {
			s.serveSlots(w, r)
		}
	case "/reset_prefix_cache":
		if s.requirePost(w, r) {
			s.eng.resetCache()
			w.WriteHeader(http.StatusOK)
		}
	default:
		return false
	}
	return true
}

// promWriter writes Prometheus's text format.
type promWriter struct {
	b      []byte
	labels string // `{...}` for every sample, or ""
	num    func([]byte, float64) []byte
}

func (p *promWriter) family(name, typ, help string) {
	p.b = append(p.b, "# HELP "...)
	p.b = append(p.b, name...)
	p.b = append(p.b, ' ')
	p.b = append(p.b, help...)
	p.b = append(p.b, "\n# TYPE "...)
	p.b = append(p.b, name...)
	p.b = append(p.b, ' ')
	p.b = append(p.b, typ...)
	p.b = append(p.b, '\n')
}

// sample writes one sample of name; extra is a label pair appended to the
// common ones ("" for none).
func (p *promWriter) sample(name, extra string, v float64) {
	p.b = append(p.b, name...)
	switch {
	case p.labels != "" && extra != "":
		p.b = append(p.b, p.labels[:len(p.labels)-1]...)
		p.b = append(p.b, ',')
		p.b = append(p.b, extra...)
		p.b = append(p.b, '}')
	case p.labels != "":
		p.b = append(p.b, p.labels...)
	case extra != "":
		p.b = append(append(append(p.b, '{'), extra...), '}')
	}
	p.b = append(p.b, ' ')
	p.b = p.num(p.b, v)
	p.b = append(p.b, '\n')
}

func (p *promWriter) metric(name, typ, help string, v float64) {
	p.family(name, typ, help)
	p.sample(name, "", v)
}

// appendInt formats integral values without a fraction, others shortest.
func appendInt(b []byte, v float64) []byte {
	if v == math.Trunc(v) && math.Abs(v) < 1<<53 {
		return strconv.AppendInt(b, int64(v), 10)
	}
	return strconv.AppendFloat(b, v, 'g', -1, 64)
}

// appendPyFloat formats as Python's repr of a float, as prometheus_client
// writes values: 3.0, 0.25, 1e-05.
func appendPyFloat(b []byte, v float64) []byte {
	if v == math.Trunc(v) && math.Abs(v) < 1e16 {
		return append(strconv.AppendInt(b, int64(v), 10), ".0"...)
	}
	return strconv.AppendFloat(b, v, 'g', -1, 64)
}

// ratio is a/b, 0 when b is 0, at most 1.
func ratio(a, b int) float64 {
	if b <= 0 {
		return 0
	}
	return min(1, float64(a)/float64(b))
}

func perSecond(n uint64, secs float64) float64 {
	if secs <= 0 {
		return 0
	}
	return float64(n) / secs
}

func (s *Server) serveMetrics(w http.ResponseWriter) {
	sn := s.eng.snapshot()
	c := &sn.c
	buf := getBuf()
	defer putBuf(buf)
	h := w.Header()
	p := promWriter{b: (*buf)[:0]}
	if s.cfg.Metrics == MetricsLlamaCpp {
		h["Content-Type"] = hdrPromText
		h["Process-Start-Time-Unix"] = []string{strconv.FormatInt(s.started.Unix(), 10)}
		p.num = appendInt
		// llama.cpp's prompt_tokens_total counts the tokens it processed:
		// those its cache did not hold.
		p.metric("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", float64(c.prefilled))
		p.metric("llamacpp:prompt_seconds_total", "counter", "Prompt process time", c.prefillTime.Seconds())
		p.metric("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", float64(c.generated))
		p.metric("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time", c.decodeTime.Seconds())
		p.metric("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", perSecond(c.prefilled, c.prefillTime.Seconds()))
		p.metric("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", perSecond(c.generated, c.decodeTime.Seconds()))
		p.metric("llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.", ratio(sn.cacheTokens, sn.capacity))
		p.metric("llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.", float64(sn.cacheTokens))
		p.metric("llamacpp:requests_processing", "gauge", "Number of requests processing.", float64(sn.running))
		p.metric("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", float64(sn.waiting))
	} else {
		h["Content-Type"] = hdrPromTextUTF8
		p.num = appendPyFloat
		p.labels = `{model_name=` + promLabelValue(s.cfg.Model) + `,engine="0"}`
		// vLLM's usage counts the blocks running requests hold, not the
		// cached blocks nobody uses (those are free to be evicted).
		usage := ratio(sn.inUseTokens, sn.capacity)
		p.metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", float64(sn.running))
		p.metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", float64(sn.waiting))
		p.metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.", usage)
		p.metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
		p.metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", float64(c.prompt))
		p.metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", float64(c.cached))
		p.metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", float64(c.prompt))
		p.metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", float64(c.generated))
		if s.cfg.CacheTokens > 0 && s.cfg.CacheBlock > 0 {
			// An info gauge, its labels the cache's config, as vLLM's
			// (no model_name: vLLM labels it with the config alone).
			p.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
			p.b = fmt.Appendf(p.b, "vllm:cache_config_info{block_size=\"%d\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_gpu_blocks=\"%d\"} 1.0\n",
				s.cfg.CacheBlock, s.cfg.CacheTokens/s.cfg.CacheBlock)
		}
		p.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
		for i, n := range c.finished {
			p.sample("vllm:request_success_total", `finished_reason="`+finishNames[i]+`"`, float64(n))
		}
	}
	*buf = p.b
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(p.b)
}

// promLabelValue quotes v as a label value of the text format.
func promLabelValue(v string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
	return `"` + r.Replace(v) + `"`
}

// slotJSON is one slot of GET /slots, in llama-server's shape; the fields
// after is_processing appear once the slot has run a task.
type slotJSON struct {
	ID                     int             `json:"id"`
	NCtx                   int             `json:"n_ctx"`
	Speculative            bool            `json:"speculative"`
	IsProcessing           bool            `json:"is_processing"`
	IDTask                 *int            `json:"id_task,omitempty"`
	NPromptTokens          *int            `json:"n_prompt_tokens,omitempty"`
	NPromptTokensProcessed *int            `json:"n_prompt_tokens_processed,omitempty"`
	NPromptTokensCache     *int            `json:"n_prompt_tokens_cache,omitempty"`
	Params                 *slotParams     `json:"params,omitempty"`
	NextToken              []slotNextToken `json:"next_token,omitempty"`
}

type slotParams struct {
	NPredict int  `json:"n_predict"`
	Stream   bool `json:"stream"`
}

type slotNextToken struct {
	HasNextToken bool `json:"has_next_token"`
	HasNewLine   bool `json:"has_new_line"`
	NRemain      int  `json:"n_remain"`
	NDecoded     int  `json:"n_decoded"`
}

// llamaUnavailable is llama-server's error body for ERROR_TYPE_UNAVAILABLE.
func llamaUnavailable(message string) []byte {
	return append(appendJSONString([]byte(`{"error":{"code":503,"message":`), message), `,"type":"unavailable_error"}}`...)
}

func (s *Server) serveSlots(w http.ResponseWriter, r *http.Request) {
	slots := s.eng.slotsSnapshot()
	if r.URL.Query().Get("fail_on_no_slot") != "" {
		idle := false
		for _, st := range slots {
			idle = idle || !st.busy
		}
		if !idle {
			s.errorsN.Add(1)
			s.writeJSON(w, http.StatusServiceUnavailable, llamaUnavailable("no slot available"))
			return
		}
	}
	// A slot's context is its share of the cache, as llama-server splits
	// its context between its slots.
	nCtx := s.cfg.CacheTokens / len(slots)
	out := make([]slotJSON, len(slots))
	for i, st := range slots {
		out[i] = slotJSON{ID: i, NCtx: nCtx, IsProcessing: st.busy}
		if st.task < 0 {
			continue
		}
		out[i].IDTask, out[i].NPromptTokens, out[i].NPromptTokensProcessed, out[i].NPromptTokensCache = &st.task, &st.prompt, &st.processed, &st.cached
		out[i].Params = &slotParams{NPredict: st.predict, Stream: st.stream}
		out[i].NextToken = []slotNextToken{{HasNextToken: st.busy && st.decoded < st.predict, NRemain: st.predict - st.decoded, NDecoded: st.decoded}}
	}
	b, err := json.Marshal(out)
	if err != nil { // not reachable: plain types
		s.writeError(w, &apiError{status: http.StatusInternalServerError, message: err.Error(), typ: "server_error"})
		return
	}
	s.writeJSON(w, http.StatusOK, b)
}
