package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// env is one proxy with role "chat" on an ephemeral loopback port.
type env struct {
	t     testing.TB
	table *placement.Table
	proxy *Proxy
	url   string // http://127.0.0.1:port
}

func newEnv(t testing.TB, cfg Config) *env {
	t.Helper()
	table, err := placement.New(placement.Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Resolver == nil {
		cfg.Resolver = table
	}
	if cfg.Peers == nil {
		cfg.Peers = table
	}
	if cfg.Server == "" {
		// INFERMESH_PROXY_SERVER=std runs the suite against net/http's
		// server and client (make test runs it both ways).
		cfg.Server = os.Getenv("INFERMESH_PROXY_SERVER")
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := p.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = p.Shutdown(ctx)
	})
	return &env{t: t, table: table, proxy: p, url: "http://" + addr.String()}
}

// upstream serves h on loopback and registers it as chat's local instance
// pinned to model.
func (e *env) upstream(h http.Handler, model string) *httptest.Server {
	e.t.Helper()
	srv := httptest.NewServer(h)
	e.t.Cleanup(srv.Close)
	if err := e.table.RegisterLocal("chat", placement.Local{Base: srv.URL, Model: model, API: "openai", Runtime: "test"}); err != nil {
		e.t.Fatal(err)
	}
	return srv
}

func (e *env) demo(delay time.Duration) *demomodel.Server {
	e.t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model = "demo"
	cfg.TokenDelay = delay
	d, err := demomodel.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.upstream(d, "demo")
	return d
}

func (e *env) client() openai.Client {
	return openai.NewClient(option.WithBaseURL(e.url+"/v1"), option.WithAPIKey("sk-local"), option.WithMaxRetries(0))
}

func (e *env) post(path, body string, hdr ...string) *http.Response {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.url+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i] == "Host" {
			req.Host = hdr[i+1]
			continue
		}
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func chatParams(model string) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:    openai.ChatModel(model),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there")},
	}
}

func TestSDKChat(t *testing.T) {
	e := newEnv(t, Config{})
	e.demo(0)
	c := e.client()
	for _, model := range []string{"chat", "demo"} {
		got, err := c.Chat.Completions.New(context.Background(), chatParams(model))
		if err != nil {
			t.Fatalf("model %s: %v", model, err)
		}
		if got.Model != model {
			t.Errorf("response model = %q, want the name asked for %q", got.Model, model)
		}
		if len(got.Choices) != 1 || got.Choices[0].Message.Content == "" {
			t.Errorf("choices = %+v, want one non-empty message", got.Choices)
		}
		if got.Usage.TotalTokens == 0 {
			t.Errorf("usage = %+v, want tokens counted", got.Usage)
		}
	}
}

func TestSDKStreamingWithUsage(t *testing.T) {
	e := newEnv(t, Config{})
	e.demo(time.Millisecond)
	c := e.client()
	params := chatParams("chat")
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := c.Chat.Completions.NewStreaming(context.Background(), params)
	var text strings.Builder
	chunks, usageChunks := 0, 0
	for stream.Next() {
		ch := stream.Current()
		chunks++
		if ch.Model != "chat" {
			t.Errorf("chunk %d model = %q, want chat", chunks, ch.Model)
		}
		if len(ch.Choices) == 0 {
			if ch.Usage.TotalTokens == 0 {
				t.Errorf("chunk %d has no choices and no usage", chunks)
			}
			usageChunks++
			continue
		}
		text.WriteString(ch.Choices[0].Delta.Content)
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if usageChunks != 1 {
		t.Errorf("usage chunks = %d, want 1", usageChunks)
	}
	if chunks < 3 || text.Len() == 0 {
		t.Errorf("chunks = %d, text = %q; want a streamed answer", chunks, text.String())
	}
	// The same request answered non-streaming gives the same text.
	got, err := c.Chat.Completions.New(context.Background(), chatParams("chat"))
	if err != nil {
		t.Fatal(err)
	}
	if got.Choices[0].Message.Content != text.String() {
		t.Errorf("non-streaming %q != streamed %q", got.Choices[0].Message.Content, text.String())
	}
}

func TestSDKEmbeddingsAndModels(t *testing.T) {
	e := newEnv(t, Config{})
	e.demo(0)
	c := e.client()
	emb, err := c.Embeddings.New(context.Background(), openai.EmbeddingNewParams{
		Model: "chat",
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"a", "b"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(emb.Data) != 2 || len(emb.Data[0].Embedding) == 0 {
		t.Fatalf("embeddings = %+v, want 2 vectors", emb.Data)
	}
	if emb.Model != "chat" {
		t.Errorf("embeddings model = %q, want chat", emb.Model)
	}
	page, err := c.Models.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range page.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != "chat,demo" {
		t.Errorf("models = %v, want [chat demo]", ids)
	}
	m, err := c.Models.Get(context.Background(), "chat")
	if err != nil || m.ID != "chat" {
		t.Errorf("models.get(chat) = %v, %v", m, err)
	}
}

func TestSDKCompletionsStreaming(t *testing.T) {
	e := newEnv(t, Config{})
	e.demo(0)
	c := e.client()
	stream := c.Completions.NewStreaming(context.Background(), openai.CompletionNewParams{
		Model:  "chat",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon")},
	})
	n := 0
	for stream.Next() {
		if m := stream.Current().Model; m != "chat" {
			t.Errorf("model = %q, want chat", m)
		}
		n++
	}
	if err := stream.Err(); err != nil || n == 0 {
		t.Fatalf("completions stream: %d chunks, err %v", n, err)
	}
}

func TestSDKErrorDecoding(t *testing.T) {
	e := newEnv(t, Config{})
	c := e.client()
	// No instance yet: 503.
	_, err := c.Chat.Completions.New(context.Background(), chatParams("chat"))
	assertAPIError(t, err, 503, "no_instance")
	e.demo(0)
	_, err = c.Chat.Completions.New(context.Background(), chatParams("gpt-4o"))
	assertAPIError(t, err, 404, "model_not_found")
}

func assertAPIError(t *testing.T, err error, status int, code string) {
	t.Helper()
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("err = %v, want *openai.Error", err)
	}
	if apiErr.StatusCode != status || apiErr.Code != code {
		t.Errorf("error = %d %q (%s), want %d %q", apiErr.StatusCode, apiErr.Code, apiErr.Message, status, code)
	}
}

func TestErrorStatuses(t *testing.T) {
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	dead := func() string { // a loopback port nothing listens on
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return "http://" + ln.Addr().String()
	}()
	tests := []struct {
		name   string
		setup  func(e *env)
		method string
		path   string
		body   string
		hdr    []string
		status int
		code   string
	}{
		{"bad json", func(e *env) { e.demo(0) }, "POST", pathChat, `{"model":`, nil, 400, "invalid_json"},
		{"model not string", func(e *env) { e.demo(0) }, "POST", pathChat, `{"model":1}`, nil, 400, "invalid_json"},
		{"not an object", func(e *env) { e.demo(0) }, "POST", pathChat, `[1]`, nil, 400, "invalid_json"},
		{"unknown model", func(e *env) { e.demo(0) }, "POST", pathChat, `{"model":"nope"}`, nil, 404, "model_not_found"},
		{"unknown path", func(e *env) { e.demo(0) }, "POST", "/v1/images/generations", `{}`, nil, 404, "unknown_url"},
		{"wrong method", func(e *env) { e.demo(0) }, "GET", pathChat, ``, nil, 405, "method_not_allowed"},
		{"too large", func(e *env) { e.demo(0) }, "POST", pathChat, `{"model":"chat","pad":"` + strings.Repeat("x", 2048) + `"}`, nil, 413, "request_too_large"},
		{"no instance", func(e *env) {}, "POST", pathChat, `{"model":"chat"}`, nil, 503, "no_instance"},
		{"upstream down", func(e *env) {
			if err := e.table.RegisterLocal("chat", placement.Local{Base: dead}); err != nil {
				t.Fatal(err)
			}
		}, "POST", pathChat, `{"model":"chat"}`, nil, 502, "upstream_failed"},
		{"upstream timeout", func(e *env) { e.upstream(slow, "") }, "POST", pathChat, `{"model":"chat"}`, nil, 504, "upstream_timeout"},
		{"foreign host", func(e *env) { e.demo(0) }, "POST", pathChat, `{}`, []string{"Host", "evil.example:18080"}, 403, "forbidden"},
		{"rebinding host", func(e *env) { e.demo(0) }, "POST", pathChat, `{}`, []string{"Host", "127.0.0.1.nip.io"}, 403, "forbidden"},
		{"foreign origin", func(e *env) { e.demo(0) }, "POST", pathChat, `{}`, []string{"Origin", "https://evil.example"}, 403, "forbidden"},
		{"null origin", func(e *env) { e.demo(0) }, "POST", pathChat, `{}`, []string{"Origin", "null"}, 403, "forbidden"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, Config{MaxBodyBytes: 1024, UpstreamTimeout: 200 * time.Millisecond})
			tt.setup(e)
			req, _ := http.NewRequest(tt.method, e.url+tt.path, strings.NewReader(tt.body))
			for i := 0; i+1 < len(tt.hdr); i += 2 {
				if tt.hdr[i] == "Host" {
					req.Host = tt.hdr[i+1]
				} else {
					req.Header.Set(tt.hdr[i], tt.hdr[i+1])
				}
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var body struct {
				Error struct {
					Message, Type, Code string
					Param               *string
				}
			}
			raw, _ := io.ReadAll(resp.Body)
			if err := jsonUnmarshal(raw, &body); err != nil {
				t.Fatalf("body %s: %v", raw, err)
			}
			if resp.StatusCode != tt.status || body.Error.Code != tt.code || body.Error.Message == "" || body.Error.Type == "" {
				t.Errorf("got %d %s, want %d with code %q", resp.StatusCode, raw, tt.status, tt.code)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("content-type = %q", ct)
			}
		})
	}
}

func TestAllowedLoopbackHosts(t *testing.T) {
	e := newEnv(t, Config{})
	e.demo(0)
	for _, h := range []string{"localhost", "localhost:18080", "127.0.0.1", "127.0.0.2:80", "[::1]:18080"} {
		resp := e.post(pathChat, `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`, "Host", h, "Origin", "http://localhost:3000")
		if resp.StatusCode != 200 {
			t.Errorf("Host %q: status %d, want 200", h, resp.StatusCode)
		}
	}
}

func TestListenRefusesNonLoopback(t *testing.T) {
	table, _ := placement.New(placement.Config{NodeID: "a"})
	p, err := New(Config{Resolver: table})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Shutdown(context.Background())
	for _, addr := range []string{"0.0.0.0:0", ":0", "192.0.2.1:80", "example.com:80"} {
		if _, err := p.Listen("chat", addr); err == nil {
			t.Errorf("Listen(%q) succeeded, want refusal", addr)
		}
	}
	if _, err := p.Listen("bad/role", "127.0.0.1:0"); err == nil {
		t.Error("Listen with an invalid role succeeded")
	}
}

// recorder is an upstream that records what it received and answers with a
// scripted SSE stream.
type recorder struct {
	mu      sync.Mutex
	headers http.Header
	body    string
	script  []string // raw SSE writes, each flushed
}

func (rc *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	rc.mu.Lock()
	rc.headers = r.Header.Clone()
	rc.body = string(b)
	rc.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Connection", "keep-alive, X-Upstream-Hop")
	w.Header().Set("X-Upstream-Hop", "secret")
	for _, s := range rc.script {
		_, _ = io.WriteString(w, s)
		http.NewResponseController(w).Flush()
	}
}

func TestSSEPassThroughAndRewrite(t *testing.T) {
	e := newEnv(t, Config{})
	rc := &recorder{script: []string{
		": keep-alive\n\n",
		`data: {"id":"1","model":"llama-3-8b","choices":[{"delta":{"content":"hi"}}],"x_unknown":{"model":"keep"}}` + "\n\n",
		"event: ping\ndata: {\"model\":\"llama-3-8b\"}\nid: 7\nretry: 100\n\n",
		`data: {"id":"1","model":"llama-3-8b","choices":[],"usage":{"total_tokens":3}}` + "\n\n",
		"data: [DONE]\n\n",
	}}
	e.upstream(rc, "llama-3-8b")
	resp := e.post(pathChat, `{"model":"chat","stream":true,"messages":[]}`,
		"Connection", "keep-alive, X-Hop", "X-Hop", "drop-me", "Keep-Alive", "timeout=5", "Authorization", "Bearer sk-app", "X-Trace", "t1")
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Join([]string{
		": keep-alive\n\n",
		`data: {"id":"1","model":"chat","choices":[{"delta":{"content":"hi"}}],"x_unknown":{"model":"keep"}}` + "\n\n",
		"event: ping\ndata: {\"model\":\"chat\"}\nid: 7\nretry: 100\n\n",
		`data: {"id":"1","model":"chat","choices":[],"usage":{"total_tokens":3}}` + "\n\n",
		"data: [DONE]\n\n",
	}, "")
	if string(raw) != want {
		t.Errorf("stream =\n%s\nwant\n%s", raw, want)
	}
	if resp.Header.Get("X-Upstream-Hop") != "" {
		t.Error("a header the upstream's Connection named was forwarded to the client")
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.body != `{"model":"llama-3-8b","stream":true,"messages":[]}` {
		t.Errorf("upstream got body %s, want the model pinned", rc.body)
	}
	for _, h := range []string{"X-Hop", "Keep-Alive", "Infermesh-Role"} {
		if v := rc.headers.Get(h); v != "" {
			t.Errorf("hop-by-hop header %s = %q reached the upstream", h, v)
		}
	}
	if rc.headers.Get("X-Trace") != "t1" || rc.headers.Get("Authorization") != "Bearer sk-app" {
		t.Errorf("end-to-end headers lost locally: %v", rc.headers)
	}
	if _, ok := rc.headers["X-Idempotency-Key"]; ok {
		t.Error("the internal replay marker reached the upstream")
	}
}

// TestSSEEventByEvent checks each event reaches the client before the
// upstream sends the next one.
func TestSSEEventByEvent(t *testing.T) {
	e := newEnv(t, Config{})
	next := make(chan struct{})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 3; i++ {
			fmt.Fprintf(w, "data: {\"model\":\"m\",\"i\":%d}\n\n", i)
			http.NewResponseController(w).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}), "m")
	resp := e.post(pathChat, `{"model":"chat","stream":true}`)
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if want := fmt.Sprintf("data: {\"model\":\"chat\",\"i\":%d}\n", i); line != want {
			t.Fatalf("event %d = %q, want %q", i, line, want)
		}
		br.ReadString('\n')
		next <- struct{}{} // the upstream only sends more once we saw this one
	}
}

func TestUpstreamFailureMidStreamAborts(t *testing.T) {
	e := newEnv(t, Config{})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"model\":\"m\",\"n\":1}\n\n")
		http.NewResponseController(w).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close() // the instance dies mid-stream
		}
	}), "m")
	resp := e.post(pathChat, `{"model":"chat","stream":true}`)
	raw, err := io.ReadAll(resp.Body)
	if err == nil {
		t.Fatalf("stream ended cleanly (%q); want an error so the client knows it is incomplete", raw)
	}
	if strings.Contains(string(raw), "[DONE]") {
		t.Errorf("aborted stream carried [DONE]: %q", raw)
	}
	if !strings.Contains(string(raw), `"n":1`) {
		t.Errorf("the event sent before the failure was lost: %q", raw)
	}
}

func TestClientCancelReachesUpstream(t *testing.T) {
	e := newEnv(t, Config{})
	started := make(chan struct{})
	ended := make(chan error, 1)
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"model\":\"m\"}\n\n")
		http.NewResponseController(w).Flush()
		close(started)
		select {
		case <-r.Context().Done():
			ended <- r.Context().Err()
		case <-time.After(10 * time.Second):
			ended <- errors.New("upstream request context never ended")
		}
	}), "m")
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.url+pathChat, strings.NewReader(`{"model":"chat","stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	cancel()
	if err := <-ended; !errors.Is(err, context.Canceled) {
		t.Errorf("upstream saw %v, want its request context canceled", err)
	}
}

func TestDemoSeesClientCancel(t *testing.T) {
	e := newEnv(t, Config{})
	d := e.demo(50 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	c := e.client()
	stream := c.Chat.Completions.NewStreaming(ctx, chatParams("chat"))
	if !stream.Next() {
		t.Fatalf("no first chunk: %v", stream.Err())
	}
	cancel()
	for stream.Next() {
	}
	stream.Close()
	deadline := time.Now().Add(5 * time.Second)
	for d.Stats().Canceled == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the demo model never saw the request canceled")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// fakeResolver returns fixed candidates.
type fakeResolver []placement.Candidate

func (f fakeResolver) Resolve(string) []placement.Candidate { return f }

// loopRemote carries "remote" requests to a local test server, keyed by node.
type loopRemote map[string]string

func (l loopRemote) RoundTrip(r *http.Request) (*http.Response, error) {
	base, ok := l[r.URL.Host]
	if !ok {
		r.Body.Close()
		return nil, fmt.Errorf("dial %s: connection refused", r.URL.Host)
	}
	r2 := r.Clone(r.Context())
	r2.URL.Scheme, r2.URL.Host = "http", strings.TrimPrefix(base, "http://")
	r2.Host = r2.URL.Host
	return http.DefaultTransport.RoundTrip(r2)
}

func TestFailoverBeforeFirstByte(t *testing.T) {
	var gotRole, gotAuth string
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotRole, gotAuth = r.Header.Get(RoleHeader), r.Header.Get("Authorization")
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"chat","served_by":"c"}`)
	}))
	defer peer.Close()
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer busy.Close()
	cands := fakeResolver{
		{Kind: placement.KindLocal, Base: "http://127.0.0.1:1", Model: "m"}, // nothing listens
		{Kind: placement.KindRemote, Node: "b"},                             // 503
		{Kind: placement.KindRemote, Node: "gone"},                          // dial fails
		{Kind: placement.KindRemote, Node: "c"},
	}
	e := newEnv(t, Config{Resolver: cands, Remote: loopRemote{"b": busy.URL, "c": peer.URL}})
	resp := e.post(pathChat, `{"model":"chat"}`, "Authorization", "Bearer sk-app")
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(string(raw), `"served_by":"c"`) {
		t.Fatalf("got %d %s, want c to serve after the others failed", resp.StatusCode, raw)
	}
	if gotRole != "chat" {
		t.Errorf("peer saw role %q, want chat", gotRole)
	}
	if gotAuth != "" {
		t.Errorf("the app's credentials were forwarded to a peer: %q", gotAuth)
	}
}

func TestLastCandidate503PassedThrough(t *testing.T) {
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"error":{"message":"loading model","type":"unavailable_error","code":503}}`)
	}))
	defer busy.Close()
	e := newEnv(t, Config{})
	if err := e.table.RegisterLocal("chat", placement.Local{Base: busy.URL}); err != nil {
		t.Fatal(err)
	}
	resp := e.post(pathChat, `{"model":"chat"}`)
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 503 || !strings.Contains(string(raw), "loading model") {
		t.Errorf("got %d %s, want the instance's 503", resp.StatusCode, raw)
	}
}

func TestPeerHandler(t *testing.T) {
	table, _ := placement.New(placement.Config{NodeID: "b"})
	cfg := demomodel.DefaultConfig()
	d, _ := demomodel.New(cfg)
	up := httptest.NewServer(d)
	defer up.Close()
	if err := table.RegisterLocal("chat", placement.Local{Base: up.URL, Model: cfg.Model}); err != nil {
		t.Fatal(err)
	}
	p, err := New(Config{Resolver: table, Peers: table})
	if err != nil {
		t.Fatal(err)
	}
	var refusals []string
	var mu sync.Mutex
	h := p.PeerHandler(func(r *http.Request) (string, bool) {
		n := r.Header.Get("X-Test-Peer")
		return n, n != ""
	}, func(r *http.Request, peer, role, why string) {
		mu.Lock()
		refusals = append(refusals, peer+"/"+role)
		mu.Unlock()
	})
	srv := httptest.NewServer(h)
	defer srv.Close()
	do := func(peer, role string) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL+pathChat, strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
		if peer != "" {
			req.Header.Set("X-Test-Peer", peer)
		}
		req.Header.Set(RoleHeader, role)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// Not exposed yet: refused, and indistinguishable from an unknown role.
	st1, b1 := do("a", "chat")
	st2, b2 := do("a", "ghost")
	if st1 != 404 || st2 != 404 || strings.Replace(b1, "chat", "ghost", 1) != b2 {
		t.Errorf("refusal reveals the role: %d %s vs %d %s", st1, b1, st2, b2)
	}
	table.ExposeToMesh("chat", true)
	if st, _ := do("a", "chat"); st != 404 {
		t.Errorf("exposed but a not on serve list: %d, want 404", st)
	}
	table.AllowMeshPeer("chat", "a", true)
	st, body := do("a", "chat")
	if st != 200 || !strings.Contains(body, `"model":"chat"`) {
		t.Errorf("allowed peer: %d %s", st, body)
	}
	if st, _ := do("", "chat"); st != 403 {
		t.Errorf("no identity: %d, want 403", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(refusals) != 3 {
		t.Errorf("refusals = %v, want 3 audited", refusals)
	}
}

func TestShutdownDrainsStreams(t *testing.T) {
	table, _ := placement.New(placement.Config{NodeID: "a"})
	cfg := demomodel.DefaultConfig()
	cfg.TokenDelay = 20 * time.Millisecond
	cfg.Tokens = 10
	d, _ := demomodel.New(cfg)
	up := httptest.NewServer(d)
	defer up.Close()
	_ = table.RegisterLocal("chat", placement.Local{Base: up.URL, Model: cfg.Model})
	p, _ := New(Config{Resolver: table})
	addr, err := p.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+addr.String()+pathChat, "application/json", strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- p.Shutdown(ctx)
	}()
	raw, err := io.ReadAll(resp.Body)
	if err != nil || !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
		t.Errorf("stream during shutdown: err %v, tail %q; want it completed", err, tail(raw))
	}
	if err := <-done; err != nil {
		t.Errorf("shutdown: %v", err)
	}
	if _, err := p.Listen("chat2", "127.0.0.1:0"); !errors.Is(err, ErrClosed) {
		t.Errorf("Listen after shutdown = %v, want ErrClosed", err)
	}
}

func tail(b []byte) string {
	if len(b) > 40 {
		b = b[len(b)-40:]
	}
	return string(b)
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
