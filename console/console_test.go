package console

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/agent/admin"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type fakeSource struct{}

func (fakeSource) Status(context.Context) (admin.Status, error) {
	return admin.Status{Node: "a", Version: "v1", Mesh: admin.MeshStatus{State: "joined", Members: 2}}, nil
}

func (fakeSource) MeshView(context.Context) (admin.MeshView, error) {
	return admin.MeshView{Node: "a", Nodes: []admin.MeshNode{
		{Name: "a", State: admin.PeerSelf, Uses: []admin.MeshUse{{Role: "chat", Nodes: []string{"b"}}}},
		{Name: "b", State: admin.PeerAdmitted, Roles: []admin.MeshRole{{Name: "chat", ServesUs: true, Load: 1}}},
	}}, nil
}

func (fakeSource) Roles(context.Context) ([]admin.Role, error) {
	return []admin.Role{{Name: "chat"}}, nil
}

func (fakeSource) Route(_ context.Context, role string) (admin.Route, error) {
	return admin.Route{Role: role, Serving: "b", Decisions: []admin.Decision{{Node: "b", Kind: "remote", Candidate: true}}}, nil
}

func (fakeSource) Events(_ context.Context, _ admin.EventsOptions, fn func(admin.Event) error) error {
	return fn(admin.Event{Kind: "mesh.joined"})
}

func (fakeSource) RecentRequests() []admin.RecentRequest {
	return []admin.RecentRequest{{ID: "req-1", Role: "chat", Source: "app", Target: "b", Status: 200, Attempts: 1}}
}

const token = "0123456789abcdef0123456789abcdef0123456789abcdef"

func startConsole(t *testing.T) *Server {
	t.Helper()
	s, err := New(Config{Listen: "127.0.0.1:0", Token: token, Source: fakeSource{}, Interval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Error(err)
		}
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return s
}

// noRedirect is a client that shows redirects instead of following them.
var noRedirect = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func get(t *testing.T, s *Server, path string, h map[string]string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "http://"+s.Addr().String()+path, nil)
	for k, v := range h {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// The guards: no token, a wrong token, a foreign Host or Origin, a
// cross-site fetch and a method that is not GET are refused; the token in
// the URL sets the cookie and redirects to the URL without it; the
// cookie, or a bearer header, is let in; every answer forbids framing and
// foreign content.
func TestGuards(t *testing.T) {
	s := startConsole(t)
	bearer := map[string]string{"Authorization": "Bearer " + token}
	for _, tt := range []struct {
		name string
		path string
		h    map[string]string
		want int
	}{
		{"no token", "/", nil, http.StatusUnauthorized},
		{"no token, the API", "/api/state", nil, http.StatusUnauthorized},
		{"wrong token", "/?token=nope", nil, http.StatusUnauthorized},
		{"wrong bearer", "/api/state", map[string]string{"Authorization": "Bearer " + strings.Repeat("x", len(token))}, http.StatusUnauthorized},
		{"wrong cookie", "/api/state", map[string]string{"Cookie": cookieName + "=nope"}, http.StatusUnauthorized},
		{"foreign host (rebinding)", "/api/state", map[string]string{"Authorization": "Bearer " + token, "Host": "evil.example:80"}, http.StatusForbidden},
		{"foreign origin", "/api/state", map[string]string{"Authorization": "Bearer " + token, "Origin": "http://evil.example"}, http.StatusForbidden},
		{"another loopback origin", "/api/state", map[string]string{"Authorization": "Bearer " + token, "Origin": "http://127.0.0.1:1"}, http.StatusForbidden},
		{"cross-site fetch", "/api/state", map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "cross-site"}, http.StatusForbidden},
		{"bearer", "/api/state", bearer, http.StatusOK},
		{"cookie", "/", map[string]string{"Cookie": cookieName + "=" + token}, http.StatusOK},
		{"own origin", "/api/state", map[string]string{"Authorization": "Bearer " + token, "Origin": "http://" + s.Addr().String()}, http.StatusOK},
		{"unknown path", "/nope", bearer, http.StatusNotFound},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp := get(t, s, tt.path, tt.h)
			if resp.StatusCode != tt.want {
				t.Errorf("GET %s = %d, want %d", tt.path, resp.StatusCode, tt.want)
			}
			if resp.Header.Get("X-Frame-Options") != "DENY" || !strings.Contains(resp.Header.Get("Content-Security-Policy"), "default-src 'none'") {
				t.Errorf("headers %v", resp.Header)
			}
		})
	}

	resp := get(t, s, "/?token="+token, nil)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/" {
		t.Fatalf("GET /?token= = %d to %q, want 303 to /", resp.StatusCode, resp.Header.Get("Location"))
	}
	var ck *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == cookieName {
			ck = c
		}
	}
	if ck == nil || ck.Value != token || !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode {
		t.Fatalf("cookie %+v, want the token, HttpOnly, SameSite=Strict", ck)
	}

	req, _ := http.NewRequest(http.MethodPost, "http://"+s.Addr().String()+"/api/state", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer "+token)
	pr, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	pr.Body.Close()
	if pr.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST = %d, want 405: the console is read-only", pr.StatusCode)
	}
}

func TestStateAndStream(t *testing.T) {
	s := startConsole(t)
	resp := get(t, s, "/api/state", map[string]string{"Authorization": "Bearer " + token})
	var st State
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	if st.Status.Node != "a" || len(st.Mesh.Nodes) != 2 || len(st.Routes) != 1 || st.Routes[0].Serving != "b" ||
		len(st.Recent) != 1 || st.Recent[0].ID != "req-1" || len(st.Events) != 1 {
		t.Fatalf("state = %+v", st)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.Addr().String()+"/api/stream", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	sr, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer sr.Body.Close()
	if ct := sr.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("stream content type %q", ct)
	}
	br := bufio.NewReader(sr.Body)
	states := 0
	for states < 2 {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("after %d states: %v", states, err)
		}
		if line == "event: state\n" {
			states++
		}
	}
	// Shutdown ends the stream (the cleanup's Shutdown would wait for it).
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	if err := s.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, br); err != nil {
		t.Logf("stream ended: %v", err)
	}
}

func TestNewRefuses(t *testing.T) {
	for _, c := range []Config{
		{Listen: "0.0.0.0:0", Token: token, Source: fakeSource{}},
		{Listen: "192.0.2.1:0", Token: token, Source: fakeSource{}},
		{Listen: "127.0.0.1:0", Token: "short", Source: fakeSource{}},
		{Listen: "127.0.0.1:0", Token: token},
	} {
		if s, err := New(c); err == nil {
			_ = s.ln.Close()
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

func TestEmbeddedPage(t *testing.T) {
	s := startConsole(t)
	for _, p := range []string{"/", "/app.js", "/style.css"} {
		resp := get(t, s, p, map[string]string{"Authorization": "Bearer " + token})
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || len(b) == 0 {
			t.Errorf("GET %s = %d, %d bytes", p, resp.StatusCode, len(b))
		}
		// The SVG namespace is a name, not a load.
		text := strings.ReplaceAll(string(b), `"http://www.w3.org/2000/svg"`, "")
		if strings.Contains(text, "http://") || strings.Contains(text, "https://") {
			t.Errorf("%s refers to another site", p)
		}
	}
}
