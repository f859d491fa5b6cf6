package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
)

// An instance cannot speak for the agent: its own Infermesh-* headers and
// X-Request-Id never reach the app, which sees this node as the one that
// served it and the request's id as this node knows it. Its other headers
// pass (the local path relays an instance's answer whole).
func TestInstanceCannotSetAgentHeaders(t *testing.T) {
	e := newEnv(t, Config{NodeName: "a"})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		h := w.Header()
		h.Set(ServedByHeader, "forged")
		h.Set(RequestIDHeader, "forged-id")
		h.Set("Infermesh-Anything", "forged")
		h.Set("X-Ratelimit-Remaining-Requests", "9")
		h.Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"model":"demo"}`)
	}), "demo")
	for _, sent := range []string{"app-id-1", ""} {
		var hdr []string
		if sent != "" {
			hdr = []string{RequestIDHeader, sent}
		}
		resp := e.post(pathChat, `{"model":"chat"}`, hdr...)
		_, _ = io.Copy(io.Discard, resp.Body)
		if got := resp.Header.Values(ServedByHeader); len(got) != 1 || got[0] != "a" {
			t.Errorf("%s = %q, want [a]", ServedByHeader, got)
		}
		id := resp.Header.Values(RequestIDHeader)
		if len(id) != 1 || id[0] == "forged-id" || (sent != "" && id[0] != sent) {
			t.Errorf("app sent id %q: %s = %q, want this node's", sent, RequestIDHeader, id)
		}
		if got := resp.Header.Get("Infermesh-Anything"); got != "" {
			t.Errorf("the instance's Infermesh-Anything reached the app: %q", got)
		}
		if got := resp.Header.Get("X-Ratelimit-Remaining-Requests"); got != "9" {
			t.Errorf("X-Ratelimit-Remaining-Requests = %q, want the instance's 9", got)
		}
	}
}

func TestResponseHeaderAllowlist(t *testing.T) {
	tests := []struct {
		k           string
		local, peer bool
	}{
		{"Content-Type", true, true},
		{"Content-Encoding", true, true},
		{"Retry-After", true, true},
		{"Retry-After-Ms", true, true},
		{"X-Should-Retry", true, true},
		{"X-Ratelimit-Remaining-Tokens", true, true},
		{"Openai-Processing-Ms", true, true},
		{"Set-Cookie", true, false},
		{"Server", true, false},
		{"Strict-Transport-Security", true, false},
		{RequestIDHeader, false, false},
		{ServedByHeader, false, false},
		{RefusedHeader, false, false},
		{"Infermesh-Load", false, false},
	}
	for _, tt := range tests {
		if got := responseHeaderOK(tt.k, false); got != tt.local {
			t.Errorf("responseHeaderOK(%s, instance) = %v, want %v", tt.k, got, tt.local)
		}
		if got := responseHeaderOK(tt.k, true); got != tt.peer {
			t.Errorf("responseHeaderOK(%s, peer) = %v, want %v", tt.k, got, tt.peer)
		}
	}
}

// The serving side applies MeshHeaders to a peer's request itself, and
// drops its query string: an admitted peer's credentials, cookies,
// forwarding headers and query never reach the instance, whatever the
// consumer sent.
func TestPeerHandlerAppliesTheMeshAllowlist(t *testing.T) {
	table, _ := placement.New(placement.Config{NodeID: "b"})
	cfg := demomodel.DefaultConfig()
	d, _ := demomodel.New(cfg)
	var mu sync.Mutex
	var seen []*http.Request
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r)
		mu.Unlock()
		d.ServeHTTP(w, r)
	}))
	defer up.Close()
	if err := table.RegisterLocal("chat", placement.Local{Base: up.URL, Model: cfg.Model}); err != nil {
		t.Fatal(err)
	}
	table.ExposeToMesh("chat", true)
	table.AllowMeshPeer("chat", "a", true)
	for _, server := range []string{ServerInfermesh, ServerStd} {
		t.Run(server, func(t *testing.T) {
			p, err := New(Config{Resolver: table, Peers: table, Server: server})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Shutdown(context.Background())
			srv := httptest.NewServer(p.PeerHandler(func(*http.Request) (string, bool) { return "a", true }, nil))
			defer srv.Close()
			req, _ := http.NewRequest(http.MethodPost, srv.URL+pathChat+"?debug=1", strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
			req.Header.Set(RoleHeader, "chat")
			req.Header.Set("Authorization", "Bearer sk-peer")
			req.Header.Set("Cookie", "session=peer")
			req.Header.Set("X-Forwarded-For", "203.0.113.7")
			req.Header.Set("X-Api-Key", "k")
			req.Header.Set("Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			mu.Lock()
			r := seen[len(seen)-1]
			mu.Unlock()
			for _, k := range []string{"Authorization", "Cookie", "X-Forwarded-For", "X-Api-Key", RoleHeader} {
				if v := r.Header.Get(k); v != "" {
					t.Errorf("the instance got the peer's %s: %q", k, v)
				}
			}
			if r.URL.RawQuery != "" {
				t.Errorf("the instance got the peer's query %q", r.URL.RawQuery)
			}
			if r.Header.Get("Traceparent") == "" {
				t.Errorf("Traceparent (in MeshHeaders) did not reach the instance")
			}
		})
	}
}
