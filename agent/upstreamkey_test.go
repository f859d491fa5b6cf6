package agent

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
)

// chatStatus posts a chat request with the app's own Authorization to base
// and returns the status.
func chatStatus(t *testing.T, base string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer sk-app")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestUpstreamAPIKeyAcrossTheMesh: b's instance requires an API key. b
// sends the key from roles.chat.upstream_api_key_file to it for its own
// apps and for a's requests over the mesh, in place of the app's
// Authorization (which never leaves a); a reload re-reads the file.
func TestUpstreamAPIKeyAcrossTheMesh(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 0)
	key := "sk-upstream-one"
	ub.key.Store(&key)
	keyFile := filepath.Join(tm.root, "b-upstream.key")
	if err := os.WriteFile(keyFile, []byte(key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}, keyFile: keyFile}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })

	if st := chatStatus(t, b.url("chat")); st != http.StatusOK {
		t.Errorf("b's app: status %d, want 200 (b sends the key)", st)
	}
	if st := chatStatus(t, a.url("chat")); st != http.StatusOK {
		t.Errorf("a's app through b: status %d, want 200 (b sends the key for peers too)", st)
	}
	ub.mu.Lock()
	auths := slices.Clone(ub.auths)
	ub.mu.Unlock()
	if want := []string{"Bearer " + key, "Bearer " + key}; !slices.Equal(auths, want) {
		t.Errorf("the instance saw Authorization %q, want %q", auths, want)
	}

	// The instance's key changes: refused (the instance's 401 reaches the
	// app) until the file holds the new key and b reloads it.
	rotated := "sk-upstream-two"
	ub.key.Store(&rotated)
	if st := chatStatus(t, a.url("chat")); st != http.StatusUnauthorized {
		t.Errorf("with a stale key: status %d, want the instance's 401", st)
	}
	if err := os.WriteFile(keyFile, []byte(rotated), 0o600); err != nil {
		t.Fatal(err)
	}
	c := admin.NewClient(filepath.Join(b.stateDir, "admin.sock"), admin.ClientOptions{})
	res, err := c.Reload(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(res.Applied, "|"); !strings.Contains(got, "roles.chat.upstream_api_key_file") || strings.Contains(got, rotated) {
		t.Errorf("reload applied %q, want the key file named and the key not shown", got)
	}
	if st := chatStatus(t, a.url("chat")); st != http.StatusOK {
		t.Errorf("after reload: status %d, want 200", st)
	}
}

// TestUpstreamAPIKeyFileChecks: the key file is refused, by its field, when
// other users can read it, when it is empty or not one line, or missing.
func TestUpstreamAPIKeyFileChecks(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", "  sk-good\n", 0o640)
	tests := []struct {
		name, path, want string
	}{
		{"world-readable", write("open", "sk-x\n", 0o644), "accessible by every user (mode 0644)"},
		{"empty", write("empty", "\n \n", 0o600), "is empty"},
		{"two lines", write("two", "sk-a\nsk-b\n", 0o600), "one line"},
		{"missing", filepath.Join(dir, "nope"), "no such file"},
		{"relative", "key.txt", "not an absolute path"},
	}
	cfgFor := func(path string) string {
		return "roles:\n  chat:\n    port: 28080\n    upstream: http://127.0.0.1:8000\n    upstream_api_key_file: " + path + "\n"
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(cfgFor(tt.path)))
			if err == nil || !strings.Contains(err.Error(), "roles.chat.upstream_api_key_file") || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v, want roles.chat.upstream_api_key_file: ... %s", err, tt.want)
			}
		})
	}
	cfg, err := ParseConfig([]byte(cfgFor(good)))
	if err != nil {
		t.Fatal(err)
	}
	if k := cfg.Roles["chat"].UpstreamKey(); k != "sk-good" {
		t.Errorf("key = %q, want sk-good (trimmed)", k)
	}
}

// TestUpstreamAPIKeyOnTheHealthPath: an instance that requires its key on
// every path, the health path included (as LiteLLM does), is probed with
// the key and so served.
func TestUpstreamAPIKeyOnTheHealthPath(t *testing.T) {
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "up.key")
	if err := os.WriteFile(keyFile, []byte("sk-everywhere\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer sk-everywhere" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status":"ok"}`)
	}))
	t.Cleanup(up.Close)
	cfg, err := ParseConfig([]byte("node: {name: n1, state_dir: " + dir + "}\nadmin: {socket: " + dir + "/admin.sock}\n" +
		"proxy: {health_interval: 50ms}\nroles:\n  chat: {port: 1, upstream: '" + up.URL + "', upstream_api_key_file: " + keyFile + "}\n"))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Roles["chat"]
	r.Port = 0
	cfg.Roles["chat"] = r
	a := runAgent(t, cfg, Options{})
	waitFor(t, "the key-protected instance to be probed up", func() bool { return len(a.Table().Resolve("chat")) == 1 })
	addr, _ := a.RoleAddr("chat")
	if st := chatStatus(t, "http://"+addr.String()); st != http.StatusOK {
		t.Errorf("chat: status %d, want 200", st)
	}
}
