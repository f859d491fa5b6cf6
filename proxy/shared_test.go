package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/placement"
)

// TestSharedPortRoutesByModel: one base URL for every role. A request goes
// to the role its model names (the role, or a model its instance serves),
// /v1/models lists what can be reached now, and what no role serves is a
// clear 404.
func TestSharedPortRoutesByModel(t *testing.T) {
	table, err := placement.New(placement.Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Config{Resolver: table, Peers: table, PinnedModel: func(role string) string {
		return map[string]string{"chat": "m-chat", "embed": "m-embed", "rerank": "m-rerank"}[role]
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = p.Shutdown(ctx)
	})
	for _, role := range []string{"chat", "embed"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"object":"served-by-`+role+`","model":"x"}`)
		}))
		t.Cleanup(srv.Close)
		if err := table.RegisterLocal(role, placement.Local{Base: srv.URL, Model: "m-" + role, API: "openai"}); err != nil {
			t.Fatal(err)
		}
	}
	roles := []string{"embed", "chat", "rerank"} // rerank: configured, its instance down
	addr, err := p.ListenShared("127.0.0.1:0", func() []string { return append([]string(nil), roles...) })
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := p.SharedAddr(); !ok || got.String() != addr.String() {
		t.Errorf("SharedAddr = %v, %v", got, ok)
	}
	base := "http://" + addr.String()
	post := func(body string) (int, string) {
		t.Helper()
		resp, err := http.Post(base+pathChat, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tt := range []struct {
		model  string
		status int
		want   string
	}{
		{"chat", 200, "served-by-chat"},
		{"embed", 200, "served-by-embed"},
		{"m-embed", 200, "served-by-embed"},
		{"m-chat", 200, "served-by-chat"},
		{"m-rerank", 503, "no_instance"},
		{"gpt-4o", 404, "model_not_found"},
	} {
		if st, body := post(`{"model":"` + tt.model + `","messages":[]}`); st != tt.status || !strings.Contains(body, tt.want) {
			t.Errorf("model %s: %d %s; want %d with %q", tt.model, st, body, tt.status, tt.want)
		}
	}
	if st, body := post(`{"messages":[]}`); st != 400 || !strings.Contains(body, "model_required") {
		t.Errorf("no model: %d %s; want 400 model_required", st, body)
	}

	resp, err := http.Get(base + pathModels)
	if err != nil {
		t.Fatal(err)
	}
	var list struct{ Data []struct{ ID string } }
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if err != nil || strings.Join(ids, ",") != "chat,m-chat,embed,m-embed" {
		t.Errorf("GET /v1/models = %v, %v; want the reachable roles and their models (not rerank: nothing serves it)", ids, err)
	}
	resp, _ = http.Get(base + pathModels + "/m-embed")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("GET /v1/models/m-embed = %d, want 200", resp.StatusCode)
	}
	if _, err := p.ListenShared("10.0.0.1:80", func() []string { return nil }); err == nil {
		t.Error("a non-loopback shared port was accepted")
	}
}
