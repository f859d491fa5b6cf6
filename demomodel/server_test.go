package demomodel

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// configForTest fills what every test wants on top of cfg.
func configForTest(t *testing.T, cfg Config) Config {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = zaptest.NewLogger(t)
	}
	return cfg
}

// startServer runs a demo model behind a real loopback HTTP server and
// returns it with an OpenAI SDK client pointed at it.
func startServer(t *testing.T, cfg Config) (*Server, *httptest.Server, openai.Client) {
	t.Helper()
	s, err := New(configForTest(t, cfg))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	client := openai.NewClient(
		option.WithBaseURL(ts.URL+"/v1/"),
		option.WithAPIKey("test"),
		option.WithHTTPClient(ts.Client()),
		option.WithMaxRetries(0),
	)
	return s, ts, client
}

func chatParams(prompt string) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:    "demo",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
	}
}

// postJSON posts body to path and returns the status and response body.
func postJSON(t *testing.T, ts *httptest.Server, path, body string) (int, http.Header, []byte) {
	t.Helper()
	return postBody(t, ts, path, strings.NewReader(body))
}

func postBody(t *testing.T, ts *httptest.Server, path string, body io.Reader) (int, http.Header, []byte) {
	t.Helper()
	resp, err := ts.Client().Post(ts.URL+path, "application/json", body)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return resp.StatusCode, resp.Header, b
}

// waitFor polls cond until it holds, failing after 30s (a bound for a
// loaded machine, not a speed).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, 30*time.Second, cond)
}

func TestChatCompletion(t *testing.T) {
	s, _, client := startServer(t, Config{Tokens: 7})
	ctx := t.Context()

	got, err := client.Chat.Completions.New(ctx, chatParams("hello there"))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if got.Object != "chat.completion" || got.Model != "demo" || !strings.HasPrefix(got.ID, "chatcmpl-") {
		t.Errorf("object, model, id = %q, %q, %q; want chat.completion, demo, chatcmpl-*", got.Object, got.Model, got.ID)
	}
	if len(got.Choices) != 1 {
		t.Fatalf("len(choices) = %d, want 1", len(got.Choices))
	}
	c := got.Choices[0]
	if c.Message.Role != "assistant" || c.FinishReason != "stop" || c.Index != 0 {
		t.Errorf("role, finish_reason, index = %q, %q, %d; want assistant, stop, 0", c.Message.Role, c.FinishReason, c.Index)
	}
	if n := len(strings.Fields(c.Message.Content)); n != 7 {
		t.Errorf("content %q has %d words, want 7", c.Message.Content, n)
	}
	u := got.Usage
	if u.CompletionTokens != 7 || u.PromptTokens < 1 || u.TotalTokens != u.PromptTokens+u.CompletionTokens {
		t.Errorf("usage = %+v, want completion 7, prompt >= 1, total = sum", u)
	}
	if got.Created <= 0 {
		t.Errorf("created = %d, want > 0", got.Created)
	}

	again, err := client.Chat.Completions.New(ctx, chatParams("hello there"))
	if err != nil {
		t.Fatalf("New again: %v", err)
	}
	if again.Choices[0].Message.Content != c.Message.Content || again.ID != got.ID {
		t.Errorf("same request: content %q id %q, want %q id %q", again.Choices[0].Message.Content, again.ID, c.Message.Content, got.ID)
	}
	other, err := client.Chat.Completions.New(ctx, chatParams("something else entirely"))
	if err != nil {
		t.Fatalf("New other: %v", err)
	}
	if other.Choices[0].Message.Content == c.Message.Content {
		t.Errorf("different prompts gave the same content %q", c.Message.Content)
	}
	if got, want := s.Stats().ChatCompletions, uint64(3); got != want {
		t.Errorf("Stats().ChatCompletions = %d, want %d", got, want)
	}
}

func TestChatMaxTokens(t *testing.T) {
	_, _, client := startServer(t, Config{Tokens: 5})
	tests := []struct {
		name       string
		set        func(p *openai.ChatCompletionNewParams)
		wantTokens int64
		wantFinish string
	}{
		{"none", func(*openai.ChatCompletionNewParams) {}, 5, "stop"},
		{"max_tokens below", func(p *openai.ChatCompletionNewParams) { p.MaxTokens = openai.Int(2) }, 2, "length"},
		{"max_tokens above", func(p *openai.ChatCompletionNewParams) { p.MaxTokens = openai.Int(50) }, 5, "stop"},
		{"max_tokens equal", func(p *openai.ChatCompletionNewParams) { p.MaxTokens = openai.Int(5) }, 5, "stop"},
		{"max_completion_tokens", func(p *openai.ChatCompletionNewParams) { p.MaxCompletionTokens = openai.Int(1) }, 1, "length"},
		{"max_completion_tokens wins", func(p *openai.ChatCompletionNewParams) {
			p.MaxTokens = openai.Int(1)
			p.MaxCompletionTokens = openai.Int(3)
		}, 3, "length"},
		{"n ignored", func(p *openai.ChatCompletionNewParams) { p.N = openai.Int(4) }, 5, "stop"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := chatParams("cap me")
			tt.set(&p)
			got, err := client.Chat.Completions.New(t.Context(), p)
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			if len(got.Choices) != 1 {
				t.Fatalf("len(choices) = %d, want 1", len(got.Choices))
			}
			c := got.Choices[0]
			if got.Usage.CompletionTokens != tt.wantTokens || int64(len(strings.Fields(c.Message.Content))) != tt.wantTokens {
				t.Errorf("completion tokens = %d, content %q; want %d", got.Usage.CompletionTokens, c.Message.Content, tt.wantTokens)
			}
			if c.FinishReason != tt.wantFinish {
				t.Errorf("finish_reason = %q, want %q", c.FinishReason, tt.wantFinish)
			}
		})
	}
}

func TestChatStreaming(t *testing.T) {
	for _, includeUsage := range []bool{true, false} {
		t.Run(map[bool]string{true: "include_usage", false: "no_usage"}[includeUsage], func(t *testing.T) {
			s, _, client := startServer(t, Config{Tokens: 6, TokenDelay: time.Millisecond})
			ctx := t.Context()
			want, err := client.Chat.Completions.New(ctx, chatParams("stream me"))
			if err != nil {
				t.Fatalf("New: %v", err)
			}

			p := chatParams("stream me")
			if includeUsage {
				p.StreamOptions.IncludeUsage = openai.Bool(true)
			}
			stream := client.Chat.Completions.NewStreaming(ctx, p)
			defer stream.Close()
			var acc openai.ChatCompletionAccumulator
			var chunks []openai.ChatCompletionChunk
			for stream.Next() {
				ch := stream.Current()
				acc.AddChunk(ch)
				chunks = append(chunks, ch)
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream: %v", err)
			}
			// 6 token chunks + the finish chunk (+ the usage chunk).
			wantChunks := 7
			if includeUsage {
				wantChunks = 8
			}
			if len(chunks) != wantChunks {
				t.Fatalf("got %d chunks, want %d", len(chunks), wantChunks)
			}
			for i, ch := range chunks {
				if ch.Object != "chat.completion.chunk" || ch.ID != want.ID || ch.Model != "demo" {
					t.Errorf("chunk %d: object, id, model = %q, %q, %q", i, ch.Object, ch.ID, ch.Model)
				}
			}
			if got := chunks[0].Choices[0].Delta.Role; got != "assistant" {
				t.Errorf("first chunk role = %q, want assistant", got)
			}
			if got := chunks[1].Choices[0].Delta.Role; got != "" {
				t.Errorf("second chunk role = %q, want none", got)
			}
			final := chunks[6]
			if len(final.Choices) != 1 || final.Choices[0].FinishReason != "stop" || final.Choices[0].Delta.Content != "" {
				t.Errorf("final chunk = %s, want empty delta with finish_reason stop", final.RawJSON())
			}
			if includeUsage {
				u := chunks[7]
				if len(u.Choices) != 0 || !u.JSON.Choices.Valid() {
					t.Errorf("usage chunk choices = %s, want []", u.JSON.Choices.Raw())
				}
				if u.Usage.CompletionTokens != 6 || u.Usage.PromptTokens != want.Usage.PromptTokens || u.Usage.TotalTokens != want.Usage.TotalTokens {
					t.Errorf("usage chunk usage = %+v, want %+v", u.Usage, want.Usage)
				}
			}
			if got := acc.Choices[0].Message.Content; got != want.Choices[0].Message.Content {
				t.Errorf("streamed content = %q, want the non-streamed %q", got, want.Choices[0].Message.Content)
			}
			// The handler counts the stream completed after its last write,
			// which the client may see first: wait for the count.
			deadline := time.Now().Add(30 * time.Second)
			st := s.Stats()
			for st.StreamsCompleted == 0 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
				st = s.Stats()
			}
			if st.StreamsStarted != 1 || st.StreamsCompleted != 1 || st.Canceled != 0 {
				t.Errorf("Stats() = %+v, want 1 stream started and completed, none canceled", st)
			}
		})
	}
}

// TestStreamWire checks the bytes on the wire: the keep-alive comment first,
// events flushed one at a time (the first token arrives while the server is
// still waiting to send the second), [DONE] last.
func TestStreamWire(t *testing.T) {
	s, ts, _ := startServer(t, Config{Tokens: 3, TokenDelay: 50 * time.Millisecond})
	body := `{"model":"demo","messages":[{"role":"user","content":"wire"}],"stream":true,"stream_options":{"include_usage":true}}`
	resp, err := ts.Client().Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	if got := resp.Header.Get("Content-Type"); got != "text/event-stream" {
		t.Errorf("Content-Type = %q, want text/event-stream", got)
	}
	br := bufio.NewReader(resp.Body)
	readEvent := func() string {
		t.Helper()
		var ev strings.Builder
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("read event: %v (so far %q)", err, ev.String())
			}
			if line == "\n" {
				return ev.String()
			}
			ev.WriteString(line)
		}
	}
	if got := readEvent(); got != ": keep-alive\n" {
		t.Errorf("first event = %q, want the keep-alive comment", got)
	}
	first := readEvent()
	if !strings.HasPrefix(first, "data: {") || !strings.Contains(first, `"role":"assistant"`) {
		t.Errorf("first data event = %q, want a chunk with the assistant role", first)
	}
	if got := s.Stats().StreamsCompleted; got != 0 {
		t.Errorf("StreamsCompleted = %d when the first token arrived; want 0 (events must be flushed as they are made)", got)
	}
	var events []string
	for {
		ev := readEvent()
		events = append(events, ev)
		if ev == "data: [DONE]\n" {
			break
		}
	}
	// 2 more tokens, finish, usage, [DONE].
	if len(events) != 5 {
		t.Fatalf("events after the first = %q, want 5", events)
	}
	for _, ev := range events[:4] {
		payload := strings.TrimSuffix(strings.TrimPrefix(ev, "data: "), "\n")
		var m map[string]any
		if err := json.Unmarshal([]byte(payload), &m); err != nil {
			t.Errorf("event %q is not JSON: %v", ev, err)
		}
		if _, ok := m["usage"]; !ok {
			t.Errorf("event %q has no usage key; with include_usage every chunk carries one", ev)
		}
	}
	if rest, _ := io.ReadAll(br); len(rest) != 0 {
		t.Errorf("bytes after [DONE] = %q, want none", rest)
	}
}

func TestStreamCancel(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(map[bool]string{true: "stream", false: "non-stream"}[stream], func(t *testing.T) {
			s, _, client := startServer(t, Config{Tokens: 100, TokenDelay: time.Hour})
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if stream {
				st := client.Chat.Completions.NewStreaming(ctx, chatParams("cancel me"))
				defer st.Close()
				if !st.Next() {
					t.Fatalf("no first chunk: %v", st.Err())
				}
				if got := st.Current().Choices[0].Delta.Role; got != "assistant" {
					t.Errorf("first chunk role = %q, want assistant", got)
				}
				cancel()
				for st.Next() {
				}
			} else {
				errc := make(chan error, 1)
				go func() {
					_, err := client.Chat.Completions.New(ctx, chatParams("cancel me"))
					errc <- err
				}()
				waitFor(t, "the request to arrive", func() bool { return s.Stats().ChatCompletions == 1 })
				cancel()
				if err := <-errc; !errors.Is(err, context.Canceled) {
					t.Errorf("New error = %v, want context.Canceled", err)
				}
			}
			waitFor(t, "the server to count the cancellation", func() bool { return s.Stats().Canceled == 1 })
			if got := s.Stats().StreamsCompleted; got != 0 {
				t.Errorf("StreamsCompleted = %d, want 0", got)
			}
		})
	}
}

func TestCompletions(t *testing.T) {
	s, _, client := startServer(t, Config{Model: "tiny", Tokens: 4})
	ctx := t.Context()
	params := openai.CompletionNewParams{
		Model:  "tiny",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
	}
	got, err := client.Completions.New(ctx, params)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if got.Object != "text_completion" || got.Model != "tiny" || !strings.HasPrefix(got.ID, "cmpl-") || len(got.Choices) != 1 {
		t.Fatalf("completion = %s, want one text_completion choice from tiny", got.RawJSON())
	}
	text := got.Choices[0].Text
	if n := len(strings.Fields(text)); n != 4 || got.Choices[0].FinishReason != "stop" {
		t.Errorf("text %q (%d words), finish %q; want 4 words, stop", text, n, got.Choices[0].FinishReason)
	}
	if got.Usage.CompletionTokens != 4 {
		t.Errorf("usage.completion_tokens = %d, want 4", got.Usage.CompletionTokens)
	}

	params.StreamOptions.IncludeUsage = openai.Bool(true)
	stream := client.Completions.NewStreaming(ctx, params)
	defer stream.Close()
	var streamed strings.Builder
	var finish string
	var usage openai.CompletionUsage
	n := 0
	for stream.Next() {
		c := stream.Current()
		n++
		if c.Object != "text_completion" {
			t.Errorf("chunk object = %q, want text_completion", c.Object)
		}
		for _, ch := range c.Choices {
			streamed.WriteString(ch.Text)
			if ch.FinishReason != "" {
				finish = string(ch.FinishReason)
			}
		}
		if c.JSON.Usage.Valid() {
			usage = c.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if streamed.String() != text || finish != "stop" || n != 6 {
		t.Errorf("streamed %q finish %q in %d chunks; want %q, stop, 6 chunks", streamed.String(), finish, n, text)
	}
	if usage.CompletionTokens != 4 || usage.TotalTokens != got.Usage.TotalTokens {
		t.Errorf("streamed usage = %+v, want %+v", usage, got.Usage)
	}

	// Token prompts work too, and differ from the string prompt.
	tok, err := client.Completions.New(ctx, openai.CompletionNewParams{
		Model:  "tiny",
		Prompt: openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{1, 2, 3}},
	})
	if err != nil {
		t.Fatalf("New with tokens: %v", err)
	}
	if tok.Choices[0].Text == text {
		t.Errorf("token prompt gave the same text as the string prompt: %q", text)
	}
	if got, want := s.Stats().Completions, uint64(3); got != want {
		t.Errorf("Stats().Completions = %d, want %d", got, want)
	}
}

func TestEmbeddings(t *testing.T) {
	s, _, client := startServer(t, Config{EmbeddingDim: 24})
	ctx := t.Context()
	tests := []struct {
		name    string
		input   openai.EmbeddingNewParamsInputUnion
		dims    int64
		wantN   int
		wantDim int
	}{
		{"string", openai.EmbeddingNewParamsInputUnion{OfString: openai.String("hello")}, 0, 1, 24},
		{"strings", openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hello", "world", "hello"}}, 0, 3, 24},
		{"tokens", openai.EmbeddingNewParamsInputUnion{OfArrayOfTokens: []int64{1, 2, 3}}, 0, 1, 24},
		{"token arrays", openai.EmbeddingNewParamsInputUnion{OfArrayOfTokenArrays: [][]int64{{1, 2, 3}, {4}}}, 0, 2, 24},
		{"dimensions", openai.EmbeddingNewParamsInputUnion{OfString: openai.String("hello")}, 5, 1, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var byFormat [2][][]float64
			for fi, format := range []openai.EmbeddingNewParamsEncodingFormat{"float", "base64"} {
				p := openai.EmbeddingNewParams{Model: "demo", Input: tt.input, EncodingFormat: format}
				if tt.dims > 0 {
					p.Dimensions = openai.Int(tt.dims)
				}
				got, err := client.Embeddings.New(ctx, p)
				if err != nil {
					t.Fatalf("%s: New: %v", format, err)
				}
				if len(got.Data) != tt.wantN || got.Model != "demo" || got.Usage.PromptTokens < 1 {
					t.Fatalf("%s: response = %s, want %d embeddings from demo with usage", format, got.RawJSON(), tt.wantN)
				}
				raw := got.Data[0].JSON.Embedding.Raw()
				if wantString := format == "base64"; (raw[0] == '"') != wantString {
					t.Errorf("%s: embedding is encoded as %.20s...", format, raw)
				}
				for i, d := range got.Data {
					if d.Index != int64(i) || len(d.Embedding) != tt.wantDim {
						t.Errorf("%s: data[%d] index %d dim %d, want %d, %d", format, i, d.Index, len(d.Embedding), i, tt.wantDim)
					}
					var sum float64
					for _, v := range d.Embedding {
						sum += v * v
					}
					if math.Abs(math.Sqrt(sum)-1) > 1e-5 {
						t.Errorf("%s: data[%d] norm = %v, want 1", format, i, math.Sqrt(sum))
					}
					byFormat[fi] = append(byFormat[fi], d.Embedding)
				}
			}
			// Both encodings carry the same float32 values (the float
			// encoding prints the shortest decimal that round-trips).
			for i := range byFormat[0] {
				for j := range byFormat[0][i] {
					if float32(byFormat[0][i][j]) != float32(byFormat[1][i][j]) {
						t.Fatalf("data[%d][%d]: float %v != base64 %v", i, j, byFormat[0][i][j], byFormat[1][i][j])
					}
				}
			}
		})
	}

	// Determinism: the same input gives the same vector, in one request or
	// across requests; different inputs differ.
	multi, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
		Model: "demo",
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hello", "world", "hello"}},
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	single, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
		Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("hello")},
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	equal := func(a, b []float64) bool {
		if len(a) != len(b) {
			return false
		}
		for i := range a {
			if a[i] != b[i] {
				return false
			}
		}
		return true
	}
	if !equal(multi.Data[0].Embedding, multi.Data[2].Embedding) || !equal(multi.Data[0].Embedding, single.Data[0].Embedding) {
		t.Errorf("\"hello\" embedded differently across positions or requests")
	}
	if equal(multi.Data[0].Embedding, multi.Data[1].Embedding) {
		t.Errorf("\"hello\" and \"world\" have the same embedding")
	}
	if got := s.Stats().Embeddings; got != uint64(2*len(tests)+2) {
		t.Errorf("Stats().Embeddings = %d, want %d", got, 2*len(tests)+2)
	}
}

func TestModels(t *testing.T) {
	s, ts, client := startServer(t, Config{Model: "org/model-7b"})
	ctx := t.Context()
	page, err := client.Models.List(ctx)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	if len(page.Data) != 1 || page.Data[0].ID != "org/model-7b" || page.Data[0].Object != "model" || page.Object != "list" {
		t.Errorf("models = %s, want a list of org/model-7b", page.RawJSON())
	}
	m, err := client.Models.Get(ctx, "org/model-7b")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if m.ID != "org/model-7b" || m.OwnedBy != "infermesh" {
		t.Errorf("model = %s", m.RawJSON())
	}
	_, err = client.Models.Get(ctx, "other")
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" {
		t.Errorf("Get(other) error = %v, want 404 model_not_found", err)
	}

	resp, err := ts.Client().Get(ts.URL + "/health")
	if err != nil {
		t.Fatalf("GET /health: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != `{"status":"ok"}` {
		t.Errorf("/health = %d %s, want 200 {\"status\":\"ok\"}", resp.StatusCode, b)
	}
	if st := s.Stats(); st.Health != 1 || st.Models != 3 {
		t.Errorf("Stats() health, models = %d, %d; want 1, 3", st.Health, st.Models)
	}
}

func TestSDKErrors(t *testing.T) {
	_, _, client := startServer(t, Config{})
	ctx := t.Context()
	tests := []struct {
		name       string
		call       func() error
		wantStatus int
		wantCode   string
		wantParam  string
	}{
		{"chat wrong model", func() error {
			p := chatParams("x")
			p.Model = "gpt-4o"
			_, err := client.Chat.Completions.New(ctx, p)
			return err
		}, 404, "model_not_found", "model"},
		{"stream wrong model", func() error {
			p := chatParams("x")
			p.Model = "gpt-4o"
			st := client.Chat.Completions.NewStreaming(ctx, p)
			defer st.Close()
			for st.Next() {
			}
			return st.Err()
		}, 404, "model_not_found", "model"},
		{"completions wrong model", func() error {
			_, err := client.Completions.New(ctx, openai.CompletionNewParams{
				Model:  "davinci",
				Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")},
			})
			return err
		}, 404, "model_not_found", "model"},
		{"embeddings wrong model", func() error {
			_, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
				Model: "ada",
				Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")},
			})
			return err
		}, 404, "model_not_found", "model"},
		{"chat max_tokens zero", func() error {
			p := chatParams("x")
			p.MaxTokens = openai.Int(0)
			_, err := client.Chat.Completions.New(ctx, p)
			return err
		}, 400, "", "max_tokens"},
		{"chat no messages", func() error {
			_, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "demo"})
			return err
		}, 400, "", "messages"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			var apiErr *openai.Error
			if !errors.As(err, &apiErr) {
				t.Fatalf("error = %v, want *openai.Error", err)
			}
			if apiErr.StatusCode != tt.wantStatus || apiErr.Code != tt.wantCode || apiErr.Param != tt.wantParam || apiErr.Type != "invalid_request_error" {
				t.Errorf("error status, code, param, type = %d, %q, %q, %q; want %d, %q, %q, invalid_request_error",
					apiErr.StatusCode, apiErr.Code, apiErr.Param, apiErr.Type, tt.wantStatus, tt.wantCode, tt.wantParam)
			}
			if apiErr.Message == "" {
				t.Errorf("error message is empty")
			}
		})
	}
}

// TestHTTPErrors covers what the SDK cannot send: broken bodies, wrong
// methods and paths.
func TestHTTPErrors(t *testing.T) {
	s, ts, _ := startServer(t, Config{})
	tests := []struct {
		name       string
		method     string
		path       string
		body       string
		wantStatus int
		wantCode   any // string or nil
		wantParam  any
		wantAllow  string
	}{
		{"bad json", "POST", "/v1/chat/completions", `{"messages":[`, 400, nil, nil, ""},
		{"trailing garbage", "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]} x`, 400, nil, nil, ""},
		{"not an object", "POST", "/v1/chat/completions", `[1,2]`, 400, nil, nil, ""},
		{"empty body", "POST", "/v1/completions", ``, 400, nil, nil, ""},
		{"empty messages", "POST", "/v1/chat/completions", `{"messages":[]}`, 400, nil, "messages", ""},
		{"stream not bool", "POST", "/v1/chat/completions", `{"messages":[{}],"stream":"yes"}`, 400, nil, "stream", ""},
		{"max_tokens fractional", "POST", "/v1/chat/completions", `{"messages":[{}],"max_tokens":1.5}`, 400, nil, "max_tokens", ""},
		{"model not string", "POST", "/v1/chat/completions", `{"messages":[{}],"model":7}`, 400, nil, "model", ""},
		{"escaped wrong model", "POST", "/v1/chat/completions", `{"messages":[{}],"model":"d\u0065mo2"}`, 404, "model_not_found", "model", ""},
		{"prompt missing", "POST", "/v1/completions", `{"model":"demo"}`, 400, nil, "prompt", ""},
		{"prompt number", "POST", "/v1/completions", `{"prompt":5}`, 400, nil, "prompt", ""},
		{"input missing", "POST", "/v1/embeddings", `{}`, 400, nil, "input", ""},
		{"input empty array", "POST", "/v1/embeddings", `{"input":[]}`, 400, nil, "input", ""},
		{"input mixed", "POST", "/v1/embeddings", `{"input":["a",1]}`, 400, nil, "input", ""},
		{"input null tokens", "POST", "/v1/embeddings", `{"input":[null]}`, 400, nil, "input", ""},
		{"bad encoding_format", "POST", "/v1/embeddings", `{"input":"a","encoding_format":"hex"}`, 400, nil, "encoding_format", ""},
		{"dimensions zero", "POST", "/v1/embeddings", `{"input":"a","dimensions":0}`, 400, nil, "dimensions", ""},
		{"GET chat", "GET", "/v1/chat/completions", ``, 405, "method_not_allowed", nil, "POST"},
		{"POST health", "POST", "/health", `{}`, 405, "method_not_allowed", nil, "GET, HEAD"},
		{"DELETE models", "DELETE", "/v1/models", ``, 405, "method_not_allowed", nil, "GET, HEAD"},
		{"unknown path", "GET", "/v2/nothing", ``, 404, "unknown_url", nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tt.method, ts.URL+tt.path, strings.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := ts.Client().Do(req)
			if err != nil {
				t.Fatalf("%s %s: %v", tt.method, tt.path, err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != tt.wantStatus {
				t.Errorf("status = %d, want %d", resp.StatusCode, tt.wantStatus)
			}
			if got := resp.Header.Get("Allow"); got != tt.wantAllow {
				t.Errorf("Allow = %q, want %q", got, tt.wantAllow)
			}
			var body struct {
				Error map[string]any `json:"error"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
				t.Fatalf("decode error body: %v", err)
			}
			e := body.Error
			if len(e) != 4 {
				t.Errorf("error object = %v, want exactly message, type, param, code", e)
			}
			if msg, _ := e["message"].(string); msg == "" || e["type"] != "invalid_request_error" {
				t.Errorf("error = %v, want a message and type invalid_request_error", e)
			}
			if e["code"] != tt.wantCode || e["param"] != tt.wantParam {
				t.Errorf("code, param = %v, %v; want %v, %v", e["code"], e["param"], tt.wantCode, tt.wantParam)
			}
		})
	}
	if got := s.Stats(); got.Errors != uint64(len(tests)) || got.NotFound != 1 {
		t.Errorf("Stats() errors, not found = %d, %d; want %d, 1", got.Errors, got.NotFound, len(tests))
	}
}

func TestBodyTooLarge(t *testing.T) {
	_, ts, _ := startServer(t, Config{})
	big := `{"input":"` + strings.Repeat("a", MaxBodyBytes) + `"}`
	for _, chunked := range []bool{false, true} {
		var r io.Reader = strings.NewReader(big)
		if chunked { // hide the length so the server has to count
			r = io.MultiReader(r)
		}
		status, _, _ := postBody(t, ts, "/v1/embeddings", r)
		if status != http.StatusRequestEntityTooLarge {
			t.Errorf("chunked=%v: status = %d, want 413", chunked, status)
		}
	}
}

// TestResponsesStrictJSON decodes every kind of success body with
// encoding/json, checking the OpenAI field set exactly.
func TestResponsesStrictJSON(t *testing.T) {
	_, ts, _ := startServer(t, Config{Model: "we\"ird\\name\u00e9", Tokens: 3, EmbeddingDim: 4})
	tests := []struct {
		path, body string
		wantKeys   []string
	}{
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, []string{"id", "object", "created", "model", "choices", "usage"}},
		{"/v1/completions", `{"prompt":["a","b"]}`, []string{"id", "object", "created", "model", "choices", "usage"}},
		{"/v1/embeddings", `{"input":[[1,2],[3]]}`, []string{"object", "data", "model", "usage"}},
		{"/v1/embeddings", `{"input":"x","encoding_format":"base64"}`, []string{"object", "data", "model", "usage"}},
	}
	for _, tt := range tests {
		t.Run(tt.path, func(t *testing.T) {
			status, hdr, b := postJSON(t, ts, tt.path, tt.body)
			if status != 200 || hdr.Get("Content-Type") != "application/json" {
				t.Fatalf("status %d content-type %q body %s", status, hdr.Get("Content-Type"), b)
			}
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatalf("body %s: %v", b, err)
			}
			if len(m) != len(tt.wantKeys) {
				t.Errorf("keys of %s, want %v", b, tt.wantKeys)
			}
			for _, k := range tt.wantKeys {
				if _, ok := m[k]; !ok {
					t.Errorf("body %s lacks %q", b, k)
				}
			}
			var model string
			if err := json.Unmarshal(m["model"], &model); err != nil || model != "we\"ird\\name\u00e9" {
				t.Errorf("model = %q (%v), want the configured name", model, err)
			}
		})
	}
}

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name      string
		cfg       Config
		wantField string // "" = valid
	}{
		{"zero", Config{}, ""},
		{"full", Config{Model: "m", Tokens: 3, TokenDelay: time.Millisecond, EmbeddingDim: 8}, ""},
		{"negative tokens", Config{Tokens: -1}, "Tokens"},
		{"huge tokens", Config{Tokens: MaxTokens + 1}, "Tokens"},
		{"negative delay", Config{TokenDelay: -time.Second}, "TokenDelay"},
		{"negative dim", Config{EmbeddingDim: -3}, "EmbeddingDim"},
		{"huge dim", Config{EmbeddingDim: MaxEmbeddingDim + 1}, "EmbeddingDim"},
		{"model with space", Config{Model: "a b"}, "Model"},
		{"model with newline", Config{Model: "a\n"}, "Model"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := New(tt.cfg)
			if tt.wantField == "" {
				if err != nil || s == nil {
					t.Fatalf("New(%+v) = %v, want a server", tt.cfg, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("New(%+v) succeeded, want an error naming %s", tt.cfg, tt.wantField)
			}
			if !strings.Contains(err.Error(), tt.wantField) {
				t.Errorf("New error = %q, want it to name %s", err, tt.wantField)
			}
		})
	}

	s, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	got, want := s.Config(), DefaultConfig()
	if got.Model != want.Model || got.Tokens != want.Tokens || got.EmbeddingDim != want.EmbeddingDim || got.TokenDelay != 0 || got.Logger == nil {
		t.Errorf("Config() of zero config = %+v, want defaults %+v", got, want)
	}
	if want.Model != "demo" || want.Tokens != 16 || want.EmbeddingDim != 16 {
		t.Errorf("DefaultConfig() = %+v, want demo, 16 tokens, 16 dims", want)
	}
}
