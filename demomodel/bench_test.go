package demomodel

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// benchWriter is a minimal reusable http.ResponseWriter so the handler
// benchmark measures the handler, not httptest.ResponseRecorder.
type benchWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *benchWriter) Header() http.Header { return w.h }
func (w *benchWriter) WriteHeader(s int)   { w.status = s }
func (w *benchWriter) Write(b []byte) (int, error) {
	w.n += len(b)
	return len(b), nil
}

const benchChatBody = `{"model":"demo","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say hello in five words."}],"max_tokens":16,"temperature":0}`

// BenchmarkChatHandler measures ServeHTTP for a small non-streaming chat
// completion in zero-delay mode, without any network.
func BenchmarkChatHandler(b *testing.B) {
	s, err := New(Config{Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(benchChatBody)
	rd := bytes.NewReader(body)
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	req.Body = io.NopCloser(rd)
	req.ContentLength = int64(len(body))
	w := &benchWriter{h: make(http.Header, 4)}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		rd.Reset(body)
		clear(w.h)
		s.ServeHTTP(w, req)
	}
	if w.status != http.StatusOK {
		b.Fatalf("status = %d", w.status)
	}
}

// BenchmarkChatLoopback measures a full keep-alive HTTP/1.1 round trip on
// loopback (client included), the shape of the benchmark's direct path.
func BenchmarkChatLoopback(b *testing.B) {
	s, err := New(Config{Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	ts := httptest.NewServer(s)
	defer ts.Close()
	client := ts.Client()
	url := ts.URL + "/v1/chat/completions"
	b.ReportAllocs()
	for b.Loop() {
		resp, err := client.Post(url, "application/json", strings.NewReader(benchChatBody))
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status = %d", resp.StatusCode)
		}
	}
}

// BenchmarkEmbeddingsHandler measures a 3-input, 16-dim float embedding.
func BenchmarkEmbeddingsHandler(b *testing.B) {
	s, err := New(Config{Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(`{"model":"demo","input":["alpha","beta","gamma"]}`)
	rd := bytes.NewReader(body)
	req := httptest.NewRequest(http.MethodPost, "/v1/embeddings", nil)
	req.Body = io.NopCloser(rd)
	req.ContentLength = int64(len(body))
	w := &benchWriter{h: make(http.Header, 4)}
	b.ReportAllocs()
	for b.Loop() {
		rd.Reset(body)
		clear(w.h)
		s.ServeHTTP(w, req)
	}
	if w.status != http.StatusOK {
		b.Fatalf("status = %d", w.status)
	}
}
