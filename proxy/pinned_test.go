package proxy

import (
	"net/http"
	"strings"
	"testing"
)

// TestPinnedModelWhileDown: while the role has no instance, a request for
// the role or its pinned model is 503 with Retry-After (the instance is
// coming back: SDKs retry), and any other model is still 404.
func TestPinnedModelWhileDown(t *testing.T) {
	e := newEnv(t, Config{PinnedModel: func(role string) string {
		if role == "chat" {
			return "llama-3-8b"
		}
		return ""
	}})
	for _, tt := range []struct {
		model      string
		status     int
		retryAfter string
	}{
		{"llama-3-8b", http.StatusServiceUnavailable, "5"},
		{"chat", http.StatusServiceUnavailable, "5"},
		{"gpt-4o", http.StatusNotFound, ""},
	} {
		resp, err := http.Post(e.url+pathChat, "application/json", strings.NewReader(`{"model":"`+tt.model+`","messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tt.status || resp.Header.Get("Retry-After") != tt.retryAfter {
			t.Errorf("model %s while down = %d, Retry-After %q; want %d, %q", tt.model, resp.StatusCode, resp.Header.Get("Retry-After"), tt.status, tt.retryAfter)
		}
	}
}
