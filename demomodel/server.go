// Package demomodel is infermesh's built-in demo model: a small
// OpenAI-compatible inference server with deterministic output. It backs
// dev mode (infermeshd -dev), tests, benchmarks (where, in zero-delay mode,
// it is the upstream whose cost we want near zero) and the infermesh-demo
// container image.
//
// Served endpoints: GET /health, GET /v1/models, GET /v1/models/{id},
// POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings.
// The same request always gets the same answer: completion tokens are
// picked from a fixed word list by a hash of the prompt, embeddings are
// unit-norm vectors seeded by a hash of each input.
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
	// Errors counts requests answered with an error status (4xx).
	Errors uint64
	// Canceled counts requests whose client went away (request context
	// ended or a write failed) before the answer was complete.
	Canceled uint64
	// StreamsStarted and StreamsCompleted count SSE streams begun and those
	// that reached "data: [DONE]".
	StreamsStarted   uint64
	StreamsCompleted uint64
}

// Server is the demo model. It is an http.Handler, safe for concurrent use;
// it starts no goroutines of its own.
type Server struct {
	cfg Config
	log *zap.Logger

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
	s := &Server{cfg: cfg, log: cfg.Logger}
	s.modelJSON = appendJSONString(nil, cfg.Model)
	s.modelObj = s.appendModelObject(nil, time.Now().Unix())
	s.modelList = append(append([]byte(`{"object":"list","data":[`), s.modelObj...), "]}"...)
	return s, nil
}

// Config returns the effective configuration, defaults filled in.
func (s *Server) Config() Config { return s.cfg }

// Stats returns a snapshot of the counters.
func (s *Server) Stats() Stats {
	return Stats{
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
	switch path := r.URL.Path; path {
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
