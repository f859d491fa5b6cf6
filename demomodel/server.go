// Package demomodel is infermesh's built-in demo model: a small
// OpenAI-compatible inference server with deterministic output. It backs
// dev mode (infermeshd -dev), tests, benchmarks (where, in zero-delay mode,
// it is the upstream whose cost we want near zero) and the infermesh-demo
// container image.
//
// Served endpoints: GET /health, GET /v1/models, GET /v1/models/{id},
// POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings;
// in engine mode also GET /metrics, GET /slots and POST
// /reset_prefix_cache (below). The same request always gets the same
// answer: completion tokens are picked from a fixed word list by a hash of
// the prompt, embeddings are unit-norm vectors seeded by a hash of each
// input.
//
// # Engine mode
//
// With Config.Parallel above 0 the model behaves like an inference server
// under load, so that where a request goes makes a difference:
//
//   - Slots. Parallel generation requests run at once, as llama-server's
//     --parallel slots; the others wait in a FIFO queue (vLLM queues
//     beyond its batch the same way). A client that goes away frees its
//     place at once: in the queue, in the prefill or while it streams.
//   - Prompt tokens, deterministically: a message's content of n bytes is
//     max(1, ceil(n/4)) tokens (token i is bytes 4i to 4i+4; the first
//     also carries the role), and a prompt is its messages' tokens in
//     order. The content is the string, or the "text" of its parts
//     concatenated; a text completion's prompt is one message. usage
//     reports this count (outside engine mode prompt_tokens is the raw
//     JSON's bytes / 4).
//   - A prefix cache. The prompt is cut into blocks of CacheBlock tokens;
//     a block's hash covers the hash of the block before it and its own
//     bytes, so it names the whole prefix up to its end. A request's
//     cached length is the longest run of leading blocks in the cache
//     (less the last token when that is the whole prompt: it is computed
//     again for its logits, as vLLM does). Once its prefill is done, the
//     prompt's full blocks go into an LRU of CacheTokens tokens, touched
//     from the last to the first, so a prefix is evicted from its end and
//     what is left stays usable (vLLM frees a request's blocks in reverse
//     order for the same reason: vllm/v1/core/kv_cache_manager.py, free).
//     POST /reset_prefix_cache empties it (vLLM's endpoint of that name).
//   - Timing. On its slot a request first sleeps PrefillPerToken per
//     uncached prompt token, then sends its first token, then one every
//     DecodePerToken; max_tokens bounds the output (Tokens otherwise).
//     Each slot runs alone: no batching slows one slot down for another.
//     As llama-server, the response head goes out with the first token.
//   - usage carries prompt_tokens_details.cached_tokens, as OpenAI's does.
//
// Stats reports the engine's own accounting: requests running and
// waiting, prompt, cached, prefilled and generated tokens, and the nominal
// prefill time (prefilled tokens × PrefillPerToken).
//
// # Metrics
//
// GET /metrics, with Config.Metrics:
//
//   - llamacpp: llama-server's --metrics, as its handler writes them
//     (ggml-org/llama.cpp tools/server/server.cpp, formerly
//     examples/server/server.cpp): every family unlabelled, with its HELP
//     and TYPE lines, the counters llamacpp:prompt_tokens_total (the
//     tokens it prefilled: cached ones are not processed),
//     prompt_seconds_total, tokens_predicted_total and
//     tokens_predicted_seconds_total, then the gauges
//     prompt_tokens_seconds, predicted_tokens_seconds,
//     kv_cache_usage_ratio (the cache's tokens ÷ its capacity),
//     kv_cache_tokens, requests_processing (busy slots) and
//     requests_deferred (waiting); Content-Type "text/plain;
//     version=0.0.4" and a Process-Start-Time-Unix header. The two
//     kv_cache gauges are from the versions before llama.cpp removed its
//     KV-cache view (2025); n_decode_total, n_busy_slots_per_decode and
//     n_tokens_max are left out (no batches here). Values are written
//     exactly, where llama.cpp's stream keeps 6 digits.
//   - vllm: vLLM's, as vllm/v1/metrics/loggers.py (PrometheusStatLogger)
//     defines them and prometheus_client writes them (counters get
//     _total, values are floats, labels model_name and engine="0"):
//     vllm:num_requests_running, num_requests_waiting,
//     kv_cache_usage_perc and the older gpu_cache_usage_perc (the blocks
//     the running requests hold ÷ the capacity: cached blocks nobody uses
//     count as free, as in vLLM), prefix_cache_queries_total and
//     prefix_cache_hits_total (in tokens), prompt_tokens_total (every
//     prompt token), generation_tokens_total and request_success_total
//     with finished_reason stop, length or abort. Histograms and the
//     _created series are left out.
//   - none: no /metrics (404), the default.
//
// GET /slots (with llamacpp only) is llama-server's: one object per slot
// with id, n_ctx (its share of CacheTokens), speculative, is_processing
// and, once the slot ran a task (it keeps the last one), id_task,
// n_prompt_tokens, n_prompt_tokens_processed, n_prompt_tokens_cache,
// params (n_predict, stream) and next_token [{has_next_token,
// has_new_line, n_remain, n_decoded}] (server_slot::to_json); with
// ?fail_on_no_slot=1 it answers 503 "no slot available" when every slot is
// busy.
//
// For Config.LoadTime after New, everything but the model list answers
// 503 {"error":{"code":503,"message":"Loading model","type":
// "unavailable_error"}}, what llama-server answers while it loads.
package demomodel

import (
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Stats is a snapshot of a Server's counters.
type Stats struct {
	// Requests by endpoint, counted on arrival whatever the outcome.
	Health          uint64
	Models          uint64
	ChatCompletions uint64
	Completions     uint64
	Embeddings      uint64
	// NotFound counts requests to unknown paths.
	NotFound uint64
	// Errors counts requests answered with an error status (4xx, and 503
	// while loading or from /slots?fail_on_no_slot).
	Errors uint64
	// Canceled counts requests whose client went away (request context
	// ended or a write failed) before the answer was complete.
	Canceled uint64
	// StreamsStarted and StreamsCompleted count SSE streams begun and those
	// that reached "data: [DONE]".
	StreamsStarted   uint64
	StreamsCompleted uint64

	// The engine's figures (engine mode only; zero otherwise).
	// Running and Waiting are the requests on a slot and in the queue
	// now.
	Running, Waiting int
	// PromptTokens are the prompt tokens of every request that got a
	// slot: CachedTokens of them came from the prefix cache and
	// PrefilledTokens were prefilled. CompletionTokens were generated.
	PromptTokens, CachedTokens, PrefilledTokens, CompletionTokens uint64
	// PrefillTime is the time prefills took (PrefilledTokens ×
	// PrefillPerToken: the engine's own accounting, not a clock).
	PrefillTime time.Duration
	// CacheTokens are the tokens the prefix cache holds now;
	// CacheEvictions counts the blocks it evicted.
	CacheTokens    int
	CacheEvictions uint64
}

// Server is the demo model. It is an http.Handler, safe for concurrent use;
// it starts no goroutines of its own.
type Server struct {
	cfg Config
	log *zap.Logger

	eng     *engine       // nil unless cfg.Parallel > 0
	decode  time.Duration // between generated tokens
	started time.Time
	readyAt time.Time        // the end of LoadTime
	now     func() time.Time // the clock of LoadTime (tests set it)

	modelJSON []byte // the served model id as a JSON string literal
	modelList []byte // the /v1/models response body
	modelObj  []byte // the /v1/models/{id} response body

	health, models, chat, completions, embeddings atomic.Uint64
	notFound, errorsN, canceled                   atomic.Uint64
	streamsStarted, streamsCompleted              atomic.Uint64
}

var _ http.Handler = (*Server)(nil)

// New validates cfg, fills its defaults and returns a Server.
func New(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, decode: max(cfg.TokenDelay, cfg.DecodePerToken), started: time.Now(), now: time.Now}
	s.readyAt = s.started.Add(cfg.LoadTime)
	if cfg.Parallel > 0 {
		s.eng = newEngine(cfg, s.decode)
	}
	s.modelJSON = appendJSONString(nil, cfg.Model)
	s.modelObj = s.appendModelObject(nil, time.Now().Unix())
	s.modelList = append(append([]byte(`{"object":"list","data":[`), s.modelObj...), "]}"...)
	return s, nil
}

// Config returns the effective configuration, defaults filled in.
func (s *Server) Config() Config { return s.cfg }

// Stats returns a snapshot of the counters.
func (s *Server) Stats() Stats {
	st := Stats{
		Health:           s.health.Load(),
		Models:           s.models.Load(),
		ChatCompletions:  s.chat.Load(),
		Completions:      s.completions.Load(),
		Embeddings:       s.embeddings.Load(),
		NotFound:         s.notFound.Load(),
		Errors:           s.errorsN.Load(),
		Canceled:         s.canceled.Load(),
		StreamsStarted:   s.streamsStarted.Load(),
		StreamsCompleted: s.streamsCompleted.Load(),
	}
	if s.eng != nil {
		sn := s.eng.snapshot()
		st.Running, st.Waiting = sn.running, sn.waiting
		st.PromptTokens, st.CachedTokens, st.PrefilledTokens, st.CompletionTokens = sn.c.prompt, sn.c.cached, sn.c.prefilled, sn.c.generated
		st.PrefillTime = sn.c.prefillTime
		st.CacheTokens, st.CacheEvictions = sn.cacheTokens, sn.evicted
	}
	return st
}

func (s *Server) appendModelObject(b []byte, created int64) []byte {
	b = append(b, `{"id":`...)
	b = append(b, s.modelJSON...)
	b = append(b, `,"object":"model","created":`...)
	b = strconv.AppendInt(b, created, 10)
	return append(b, `,"owned_by":"infermesh"}`...)
}

// Shared header values. net/http only reads them, so one slice can serve
// every response (and assigning the map entry directly skips key
// canonicalization).
var (
	hdrJSON        = []string{"application/json"}
	hdrEventStream = []string{"text/event-stream"}
	hdrNoCache     = []string{"no-cache"}
	hdrAllowGet    = []string{"GET, HEAD"}
	hdrAllowPost   = []string{"POST"}
)

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	path := r.URL.Path
	if s.cfg.LoadTime > 0 && s.now().Before(s.readyAt) && path != "/v1/models" && !strings.HasPrefix(path, "/v1/models/") {
		// llama-server while it loads: the model list answers, nothing else.
		if path == "/health" {
			s.health.Add(1)
		}
		s.errorsN.Add(1)
		s.writeJSON(w, http.StatusServiceUnavailable, llamaUnavailable("Loading model"))
		return
	}
	if s.eng != nil && s.serveEngine(w, r) {
		return
	}
	switch path {
	case "/v1/chat/completions":
		s.chat.Add(1)
		if s.requirePost(w, r) {
			s.serveGenerate(w, r, &chatKind)
		}
	case "/v1/completions":
		s.completions.Add(1)
		if s.requirePost(w, r) {
			s.serveGenerate(w, r, &textKind)
		}
	case "/v1/embeddings":
		s.embeddings.Add(1)
		if s.requirePost(w, r) {
			s.serveEmbeddings(w, r)
		}
	case "/health":
		s.health.Add(1)
		if s.requireGet(w, r) {
			s.writeJSON(w, http.StatusOK, []byte(`{"status":"ok"}`))
		}
	case "/v1/models":
		s.models.Add(1)
		if s.requireGet(w, r) {
			s.writeJSON(w, http.StatusOK, s.modelList)
		}
	default:
		if id, ok := strings.CutPrefix(path, "/v1/models/"); ok {
			s.models.Add(1)
			if !s.requireGet(w, r) {
				return
			}
			if id != s.cfg.Model {
				s.writeError(w, errModelNotFound(id))
				return
			}
			s.writeJSON(w, http.StatusOK, s.modelObj)
			return
		}
		s.notFound.Add(1)
		s.writeError(w, &apiError{
			status:  http.StatusNotFound,
			message: "Invalid URL (" + r.Method + " " + path + ")",
			typ:     "invalid_request_error",
			code:    "unknown_url",
		})
	}
}

func (s *Server) requirePost(w http.ResponseWriter, r *http.Request) bool {
	if r.Method == http.MethodPost {
		return true
	}
	w.Header()["Allow"] = hdrAllowPost
	s.writeError(w, errMethod(r.Method))
	return false
}

func (s *Server) requireGet(w http.ResponseWriter, r *http.Request) bool {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		return true
	}
	w.Header()["Allow"] = hdrAllowGet
	s.writeError(w, errMethod(r.Method))
	return false
}

// writeJSON writes a complete JSON body. Bodies that fit net/http's 2 KiB
// pre-chunking buffer get their Content-Length from net/http for free; larger
// ones get it set here so they are not chunked.
func (s *Server) writeJSON(w http.ResponseWriter, status int, body []byte) {
	h := w.Header()
	h["Content-Type"] = hdrJSON
	if len(body) > 2048 {
		h["Content-Length"] = []string{strconv.Itoa(len(body))}
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// apiError is an error answered in OpenAI's shape:
// {"error":{"message","type","param","code"}}. Empty param or code is null.
type apiError struct {
	status  int
	message string
	typ     string
	param   string
	code    string
}

func (e *apiError) Error() string { return e.message }

func errModelNotFound(model string) *apiError {
	return &apiError{
		status:  http.StatusNotFound,
		message: "The model `" + model + "` does not exist or you do not have access to it.",
		typ:     "invalid_request_error",
		param:   "model",
		code:    "model_not_found",
	}
}

func errMethod(method string) *apiError {
	return &apiError{
		status:  http.StatusMethodNotAllowed,
		message: "method " + method + " not allowed",
		typ:     "invalid_request_error",
		code:    "method_not_allowed",
	}
}

func errInvalid(param, message string) *apiError {
	return &apiError{
		status:  http.StatusBadRequest,
		message: message,
		typ:     "invalid_request_error",
		param:   param,
	}
}

var (
	errBadJSON = &apiError{
		status:  http.StatusBadRequest,
		message: "We could not parse the JSON body of your request.",
		typ:     "invalid_request_error",
	}
	errNotObject = &apiError{
		status:  http.StatusBadRequest,
		message: "The JSON body of your request must be an object.",
		typ:     "invalid_request_error",
	}
)

func (s *Server) writeError(w http.ResponseWriter, e *apiError) {
	s.errorsN.Add(1)
	b := make([]byte, 0, 128+len(e.message))
	b = append(b, `{"error":{"message":`...)
	b = appendJSONString(b, e.message)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, e.typ)
	b = append(b, `,"param":`...)
	b = appendNullableString(b, e.param)
	b = append(b, `,"code":`...)
	b = appendNullableString(b, e.code)
	b = append(b, "}}"...)
	s.writeJSON(w, e.status, b)
}

func appendNullableString(b []byte, s string) []byte {
	if s == "" {
		return append(b, "null"...)
	}
	return appendJSONString(b, s)
}

// bufPool holds request and response buffers. Buffers that grew past
// maxPooledBuf are dropped rather than pinned.
var bufPool = sync.Pool{New: func() any {
	b := make([]byte, 0, 4096)
	return &b
}}

const maxPooledBuf = 1 << 20

func getBuf() *[]byte { return bufPool.Get().(*[]byte) }

func putBuf(b *[]byte) {
	if cap(*b) > maxPooledBuf {
		return
	}
	*b = (*b)[:0]
	bufPool.Put(b)
}

var errTooLarge = &apiError{
	status:  http.StatusRequestEntityTooLarge,
	message: "request body too large",
	typ:     "invalid_request_error",
}

// readBody reads the request body into *buf (a pooled buffer) and returns
// it. An *apiError is returned for bodies too large; other errors mean the
// client went away or sent a broken body.
func readBody(r *http.Request, buf *[]byte) ([]byte, error) {
	if r.ContentLength > MaxBodyBytes {
		return nil, errTooLarge
	}
	b := (*buf)[:0]
	if n := int(r.ContentLength); n > 0 && cap(b) < n+1 {
		b = make([]byte, 0, n+1) // +1 so the final Read sees EOF without growing
	}
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Body.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if len(b) > MaxBodyBytes {
			*buf = b
			return nil, errTooLarge
		}
		if err == io.EOF {
			*buf = b
			return b, nil
		}
		if err != nil {
			*buf = b
			return nil, err
		}
	}
}

// readRequest reads and validates the body as a JSON object. On failure it
// has answered (or counted the cancellation) and returns false.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, buf *[]byte) ([]byte, bool) {
	body, err := readBody(r, buf)
	if err != nil {
		var ae *apiError
		if errors.As(err, &ae) {
			s.writeError(w, ae)
			return nil, false
		}
		if r.Context().Err() != nil {
			s.canceled.Add(1)
			return nil, false
		}
		s.writeError(w, errInvalid("", "could not read request body: "+err.Error()))
		return nil, false
	}
	return body, true
}

// checkModel answers 404 model_not_found unless the requested model (raw
// JSON value, or nil if absent) is empty or the served one.
func (s *Server) checkModel(w http.ResponseWriter, raw []byte) bool {
	if raw == nil || isNull(raw) {
		return true
	}
	m, ok := stringValue(raw)
	if !ok {
		s.writeError(w, errInvalid("model", "model must be a string"))
		return false
	}
	if len(m) == 0 || string(m) == s.cfg.Model {
		return true
	}
	s.writeError(w, errModelNotFound(string(m)))
	return false
}
