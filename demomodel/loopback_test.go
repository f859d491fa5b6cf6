package demomodel

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestServeLoopback(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Model = "m"
	base, stop, err := ServeLoopback(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(base, "http://127.0.0.1:") {
		t.Errorf("base = %q, want a 127.0.0.1 URL", base)
	}
	resp, err := http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"id":"m"`) {
		t.Errorf("GET /v1/models = %d %s, want model m", resp.StatusCode, body)
	}
	stop()
	if _, err := http.Get(base + "/health"); err == nil {
		t.Error("the server still answers after stop")
	}
	if _, _, err := ServeLoopback(Config{Tokens: -1}); err == nil {
		t.Error("ServeLoopback accepted a bad config")
	}
}
