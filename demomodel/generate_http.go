package demomodel

import (
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/ctxwait"
	"github.com/infermesh/infermesh/internal/jsonskip"
	"github.com/infermesh/infermesh/internal/prompt"
)

// genKind describes one of the two generation endpoints: chat completions
// and legacy text completions. They share parsing, generation and streaming
// and differ in field and object names.
type genKind struct {
	endpoint    string // for logs
	promptField string // "messages" or "prompt"
	idPrefix    string
	object      string // object of the complete response
	chunkObject string // object of a streamed chunk
	chat        bool
}

var (
	chatKind = genKind{
		endpoint:    "chat.completions",
		promptField: "messages",
		idPrefix:    "chatcmpl-",
		object:      "chat.completion",
		chunkObject: "chat.completion.chunk",
		chat:        true,
	}
	textKind = genKind{
		endpoint:    "completions",
		promptField: "prompt",
		idPrefix:    "cmpl-",
		object:      "text_completion",
		chunkObject: "text_completion",
	}
)

// genRequest holds the few request fields the demo model reads; everything
// else (temperature, tools, n, ...) is accepted and ignored.
type genRequest struct {
	model        []byte // raw JSON value, nil if absent
	prompt       []byte // raw JSON value of messages / prompt
	stream       bool
	includeUsage bool
	maxTokens    int64 // 0 = not given
}

// parseGen reads the fields of a generation request from a valid JSON body.
func parseGen(body []byte, k *genKind) (genRequest, *apiError) {
	var req genRequest
	it, ok := newObjIter(body)
	if !ok {
		return req, errNotObject
	}
	var maxTokens, maxCompletionTokens []byte
	for {
		key, val, ok := it.next()
		if !ok {
			break
		}
		switch {
		case keyIs(key, k.promptField):
			req.prompt = val
		case keyIs(key, "model"):
			req.model = val
		case keyIs(key, "stream"):
			if isNull(val) {
				req.stream = false
				continue
			}
			b, ok := boolValue(val)
			if !ok {
				return req, errInvalid("stream", "stream must be a boolean")
			}
			req.stream = b
		case keyIs(key, "stream_options"):
			if isNull(val) {
				req.includeUsage = false
				continue
			}
			u, e := parseStreamOptions(val)
			if e != nil {
				return req, e
			}
			req.includeUsage = u
		case keyIs(key, "max_tokens"):
			maxTokens = val
		case k.chat && keyIs(key, "max_completion_tokens"):
			maxCompletionTokens = val
		}
	}
	switch {
	case req.prompt == nil || isNull(req.prompt):
		return req, errInvalid(k.promptField, k.promptField+" is required")
	case k.chat && !isNonEmptyArray(req.prompt):
		return req, errInvalid("messages", "messages must be a non-empty array")
	case !k.chat && req.prompt[0] != '"' && req.prompt[0] != '[':
		return req, errInvalid("prompt", "prompt must be a string or an array")
	}
	for _, f := range [...]struct {
		name string
		val  []byte
	}{{"max_tokens", maxTokens}, {"max_completion_tokens", maxCompletionTokens}} {
		// Later entries win: max_completion_tokens supersedes max_tokens.
		if f.val == nil || isNull(f.val) {
			continue
		}
		n, ok := intValue(f.val)
		if !ok || n < 1 {
			return req, errInvalid(f.name, f.name+" must be an integer >= 1")
		}
		req.maxTokens = n
	}
	return req, nil
}

func parseStreamOptions(val []byte) (includeUsage bool, e *apiError) {
	it, ok := newObjIter(val)
	if !ok {
		return false, errInvalid("stream_options", "stream_options must be an object")
	}
	for {
		key, v, ok := it.next()
		if !ok {
			return includeUsage, nil
		}
		if keyIs(key, "include_usage") && !isNull(v) {
			b, ok := boolValue(v)
			if !ok {
				return false, errInvalid("stream_options.include_usage", "include_usage must be a boolean")
			}
			includeUsage = b
		}
	}
}

// generation is what one request will produce.
type generation struct {
	seed         uint64
	tokens       int
	promptTokens int
	finish       string // "stop", or "length" when max_tokens cut the answer short
	created      int64
	// job is the request's slot in engine mode (nil otherwise), and
	// cachedTokens its prompt tokens found in the prefix cache.
	job          *job
	cachedTokens int
}

// done records that the answer is complete.
func (g *generation) done() {
	if g.job == nil {
		return
	}
	g.job.reason = finishStop
	if g.finish == "length" {
		g.job.reason = finishLength
	}
}

func (s *Server) serveGenerate(w http.ResponseWriter, r *http.Request, k *genKind) {
	buf := getBuf()
	defer putBuf(buf)
	body, ok := s.readRequest(w, r, buf)
	if !ok {
		return
	}
	if !jsonskip.Valid(body) {
		s.writeError(w, errBadJSON)
		return
	}
	req, e := parseGen(body, k)
	if e != nil {
		s.writeError(w, e)
		return
	}
	if !s.checkModel(w, req.model) {
		return
	}
	g := generation{
		seed:         prompt.HashBytes(fnvOffset, req.prompt),
		tokens:       s.cfg.Tokens,
		promptTokens: estimateTokens(len(req.prompt)),
		finish:       "stop",
		created:      time.Now().Unix(),
	}
	if req.maxTokens > 0 && req.maxTokens < int64(g.tokens) {
		g.tokens = int(req.maxTokens)
		g.finish = "length"
	}
	if s.eng != nil {
		// A slot, then the prefill of what the cache does not hold; the
		// response begins with the first token, as llama-server's does.
		p := tokenizePrompt(req.prompt, k.chat, s.cfg.CacheBlock, nil)
		j, err := s.eng.admit(r.Context(), p, g.tokens, req.stream)
		if err != nil {
			s.canceled.Add(1)
			return
		}
		defer j.finish()
		g.job, g.promptTokens, g.cachedTokens = j, p.n, j.cached
		if !j.prefill(r.Context()) {
			s.canceled.Add(1)
			return
		}
	}
	if ce := s.log.Check(zap.DebugLevel, "generate"); ce != nil {
		ce.Write(zap.String("endpoint", k.endpoint), zap.Bool("stream", req.stream),
			zap.Int("tokens", g.tokens), zap.Uint64("seed", g.seed), zap.Int("cached_tokens", g.cachedTokens))
	}
	if req.stream {
		s.stream(w, r, k, &g, req.includeUsage, buf)
		return
	}
	// Simulate generation time: the answer is ready when the last token
	// would have been streamed.
	if d := s.decode * time.Duration(g.tokens-1); d > 0 {
		if !ctxwait.Sleep(r.Context(), d) {
			s.canceled.Add(1)
			return
		}
	}
	if g.job != nil {
		g.job.tokens(g.tokens)
		g.done()
	}
	b := s.appendHead((*buf)[:0], k, k.object, &g)
	if k.chat {
		b = append(b, `{"index":0,"message":{"role":"assistant","content":"`...)
		b = appendTokens(b, g.seed, g.tokens)
		b = append(b, `","refusal":null},"logprobs":null,"finish_reason":"`...)
	} else {
		b = append(b, `{"text":"`...)
		b = appendTokens(b, g.seed, g.tokens)
		b = append(b, `","index":0,"logprobs":null,"finish_reason":"`...)
	}
	b = append(b, g.finish...)
	b = append(b, `"}],`...)
	b = appendUsage(b, &g)
	b = append(b, '}')
	*buf = b
	s.writeJSON(w, http.StatusOK, b)
}

// appendHead appends `{"id":...,"object":...,"created":...,"model":...,"choices":[`.
func (s *Server) appendHead(b []byte, k *genKind, object string, g *generation) []byte {
	b = append(b, `{"id":"`...)
	b = append(b, k.idPrefix...)
	b = strconv.AppendUint(b, g.seed, 16)
	b = append(b, `","object":"`...)
	b = append(b, object...)
	b = append(b, `","created":`...)
	b = strconv.AppendInt(b, g.created, 10)
	b = append(b, `,"model":`...)
	b = append(b, s.modelJSON...)
	return append(b, `,"choices":[`...)
}

// appendUsage appends `"usage":{...}`.
func appendUsage(b []byte, g *generation) []byte {
	b = append(b, `"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(g.promptTokens), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(g.tokens), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(g.promptTokens+g.tokens), 10)
	if g.job != nil {
		b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
		b = strconv.AppendInt(b, int64(g.cachedTokens), 10)
		b = append(b, '}')
	}
	return append(b, '}')
}

var (
	sseKeepAlive = []byte(": keep-alive\n\n")
	sseDone      = []byte("data: [DONE]\n\n")
)

// stream answers with server-sent events: a keep-alive comment, one chunk
// per token (TokenDelay, or DecodePerToken, apart), a final chunk with the finish reason, the
// usage chunk if asked for, and [DONE]. Every event is flushed. It stops as
// soon as the request context ends or a write fails, counting the request
// as canceled.
func (s *Server) stream(w http.ResponseWriter, r *http.Request, k *genKind, g *generation, includeUsage bool, buf *[]byte) {
	s.streamsStarted.Add(1)
	h := w.Header()
	h["Content-Type"] = hdrEventStream
	h["Cache-Control"] = hdrNoCache
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	ctx := r.Context()

	emit := func(b []byte) bool {
		if _, err := w.Write(b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	canceled := func(why string) {
		s.canceled.Add(1)
		if ce := s.log.Check(zap.DebugLevel, "stream canceled"); ce != nil {
			ce.Write(zap.String("endpoint", k.endpoint), zap.String("reason", why))
		}
	}
	if !emit(sseKeepAlive) {
		canceled("write failed")
		return
	}

	// b[:prefix] is `data: {"id":...,"choices":[`, shared by every chunk.
	b := append((*buf)[:0], "data: "...)
	b = s.appendHead(b, k, k.chunkObject, g)
	prefix := len(b)
	tail := "]}\n\n"
	if includeUsage {
		tail = `],"usage":null}` + "\n\n"
	}

	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		*buf = b
	}()
	for i := 0; i < g.tokens; i++ {
		if i > 0 && s.decode > 0 {
			if timer == nil {
				timer = time.NewTimer(s.decode)
			} else {
				timer.Reset(s.decode)
			}
			select {
			case <-ctx.Done():
				canceled(ctx.Err().Error())
				return
			case <-timer.C:
			}
		} else if ctx.Err() != nil {
			canceled(ctx.Err().Error())
			return
		}
		b = b[:prefix]
		tok := token(g.seed, i)
		if k.chat {
			b = append(b, `{"index":0,"delta":{`...)
			if i == 0 {
				b = append(b, `"role":"assistant",`...)
			}
			b = append(b, `"content":"`...)
			b = append(b, tok...)
			b = append(b, `"},"logprobs":null,"finish_reason":null}`...)
		} else {
			b = append(b, `{"text":"`...)
			b = append(b, tok...)
			b = append(b, `","index":0,"logprobs":null,"finish_reason":null}`...)
		}
		b = append(b, tail...)
		if !emit(b) {
			canceled("write failed")
			return
		}
		if g.job != nil {
			g.job.tokens(1)
		}
	}

	b = b[:prefix]
	if k.chat {
		b = append(b, `{"index":0,"delta":{},"logprobs":null,"finish_reason":"`...)
	} else {
		b = append(b, `{"text":"","index":0,"logprobs":null,"finish_reason":"`...)
	}
	b = append(b, g.finish...)
	b = append(b, `"}`...)
	b = append(b, tail...)
	if !emit(b) {
		canceled("write failed")
		return
	}
	if includeUsage {
		b = b[:prefix]
		b = append(b, "],"...)
		b = appendUsage(b, g)
		b = append(b, "}\n\n"...)
		if !emit(b) {
			canceled("write failed")
			return
		}
	}
	if !emit(sseDone) {
		canceled("write failed")
		return
	}
	g.done()
	s.streamsCompleted.Add(1)
}
