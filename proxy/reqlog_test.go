package proxy

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRequestIDServedByAndAccessLog: every response carries the request
// id (the client's when usable, else a new one), the instance sees the
// same id, the response names the node, and the access log has one line
// per request with what an operator looks for.
func TestRequestIDServedByAndAccessLog(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	e := newEnv(t, Config{NodeName: "node-a", AccessLog: zap.New(core)})
	var mu sync.Mutex
	var seen []string
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Header.Get(RequestIDHeader))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","model":"m","choices":[]}`)
	}), "m")

	tests := []struct {
		name, sent string
		keep       bool
	}{
		{"client id kept", "trace-0af7651916cd43dd8448eb211c80319c", true},
		{"no id: one is made", "", false},
		{"unusable id replaced", "has space", false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var hdr []string
			if tt.sent != "" {
				hdr = []string{RequestIDHeader, tt.sent}
			}
			resp := e.post(pathChat, `{"model":"chat","messages":[]}`, hdr...)
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			got := resp.Header.Get(RequestIDHeader)
			mu.Lock()
			up := seen[i]
			mu.Unlock()
			if got == "" || got != up || (tt.keep && got != tt.sent) || (!tt.keep && got == tt.sent) {
				t.Errorf("response id %q, instance saw %q, client sent %q (keep %v)", got, up, tt.sent, tt.keep)
			}
			if sb := resp.Header.Get(ServedByHeader); sb != "node-a" {
				t.Errorf("%s = %q, want node-a", ServedByHeader, sb)
			}
			entries := logs.FilterField(zap.String("id", got)).All()
			if len(entries) != 1 {
				t.Fatalf("access log lines for %s = %d, want 1", got, len(entries))
			}
			f := entries[0].ContextMap()
			if f["role"] != "chat" || f["model"] != "chat" || f["status"] != int64(200) || f["served_by"] != "node-a" ||
				f["source"] != "app" || f["bytes"].(int64) <= 0 || f["aborted"] != false {
				t.Errorf("access log line = %v", f)
			}
		})
	}

	// A refusal is logged too, and answers with an id.
	resp := e.post(pathChat, `{"model":"gpt-4o","messages":[]}`)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || resp.Header.Get(RequestIDHeader) == "" {
		t.Errorf("refusal = %d with id %q; want 404 with an id", resp.StatusCode, resp.Header.Get(RequestIDHeader))
	}
	if n := logs.FilterField(zap.Int("status", 404)).Len(); n != 1 {
		t.Errorf("404 lines = %d, want 1", n)
	}
	// Refused before the body is read (a cross-origin request): logged,
	// without a model.
	resp = e.post(pathChat, `{"model":"chat"}`, "Origin", "https://evil.example")
	resp.Body.Close()
	if all := logs.FilterField(zap.Int("status", 403)).All(); resp.StatusCode != 403 || len(all) != 1 || all[0].ContextMap()["model"] != "" {
		t.Errorf("cross-origin refusal = %d, logged %v; want 403 logged without a model", resp.StatusCode, all)
	}
	if !strings.HasPrefix(newRequestID(), idPrefix) || newRequestID() == newRequestID() {
		t.Error("generated ids are not unique")
	}
}

// TestAccessLogSampling: with every success skipped, errors are still
// logged.
func TestAccessLogSampling(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	e := newEnv(t, Config{AccessLog: zap.New(core), AccessLogSkip: 1})
	e.demo(0)
	for range 5 {
		resp := e.post(pathChat, `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	resp := e.post(pathChat, `{"model":"nope"}`)
	resp.Body.Close()
	if all := logs.All(); len(all) != 1 || all[0].ContextMap()["status"] != int64(404) {
		t.Errorf("access log = %v, want only the 404", all)
	}
	if _, err := New(Config{Resolver: e.table, AccessLogSkip: 2}); err == nil {
		t.Error("AccessLogSkip 2 accepted")
	}
}
