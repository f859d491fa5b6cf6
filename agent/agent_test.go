package agent

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

func TestMain(m *testing.M) {
	leakcheck.VerifyTestMain(m, bins.Remove)
}

// runAgent starts a with cfg and stops it at cleanup.
func runAgent(t *testing.T, cfg *Config, opts Options) *Agent {
	t.Helper()
	a, err := New(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	waitFor(t, "role listeners", func() bool {
		for name := range cfg.Roles {
			if _, ok := a.RoleAddr(name); !ok {
				return false
			}
		}
		return true
	})
	return a
}

// waitFor polls cond every 10ms until it holds, failing t after 30s: a
// bound for a machine with a load average of 15 under -race, not a speed.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, 30*time.Second, cond)
}

// demoDevModel is dev mode's model as cmd/infermeshd wires it: the
// built-in demo model.
func demoDevModel(model string) (string, func(), error) {
	cfg := demomodel.DefaultConfig()
	cfg.Model = model
	return demomodel.ServeLoopback(cfg)
}

func TestDevModeStreamsChat(t *testing.T) {
	cfg, err := DevConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Roles["chat"]
	r.Port = 0 // the real dev port may be taken on a developer's machine
	cfg.Roles["chat"] = r
	var mu sync.Mutex
	var notes []string
	a := runAgent(t, cfg, Options{DevModel: demoDevModel, Notify: func(s string) { mu.Lock(); notes = append(notes, s); mu.Unlock() }})
	addr, _ := a.RoleAddr("chat")
	waitFor(t, "the demo instance to register", func() bool { return len(a.Table().Resolve("chat")) == 1 })
	resp, err := http.Post("http://"+addr.String()+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), `"model":"chat"`) || !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
		t.Errorf("dev stream = %q, want chunks for model chat ending with [DONE]", raw)
	}
	// Run tells systemd it is ready once everything is up, which may be
	// just after the role answers.
	waitFor(t, "a notification", func() bool { mu.Lock(); defer mu.Unlock(); return len(notes) > 0 })
	mu.Lock()
	defer mu.Unlock()
	if notes[0] != "READY=1" {
		t.Errorf("notify = %v, want READY=1 first", notes)
	}
}

// TestHealthFlapping: a static upstream is served only while it answers.
func TestHealthFlapping(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	upAddr := ln.Addr().String()
	d, _ := demomodel.New(demomodel.DefaultConfig())
	serve := func(ln net.Listener) (stop func()) {
		srv := &http.Server{Handler: d}
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.Serve(ln) }()
		return func() { _ = srv.Close(); <-done }
	}
	stop := serve(ln)

	cfg, err := ParseConfig([]byte(`
node: {name: a}
proxy: {health_interval: 20ms}
roles:
  chat: {port: 1, upstream: "http://` + upAddr + `", model: demo}
`))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Node.StateDir = t.TempDir()
	cfg.Admin.Socket = filepath.Join(cfg.Node.StateDir, "admin.sock")
	r := cfg.Roles["chat"]
	r.Port = 0
	cfg.Roles["chat"] = r
	a := runAgent(t, cfg, Options{})
	addr, _ := a.RoleAddr("chat")
	status := func() int {
		resp, err := http.Post("http://"+addr.String()+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	served := func() bool { return len(a.Table().Resolve("chat")) == 1 }

	waitFor(t, "registration", served)
	if got := status(); got != 200 {
		t.Fatalf("status while up = %d, want 200", got)
	}
	stop()
	waitFor(t, "deregistration", func() bool { return !served() })
	if got := status(); got != 503 {
		t.Errorf("status while down = %d, want 503", got)
	}
	ln2, err := net.Listen("tcp", upAddr)
	if err != nil {
		t.Fatalf("re-listening on %s: %v", upAddr, err)
	}
	stop = serve(ln2)
	defer stop()
	waitFor(t, "registration again", served)
	if got := status(); got != 200 {
		t.Errorf("status after return = %d, want 200", got)
	}
}

func TestAdminSocketModes(t *testing.T) {
	for _, tt := range []struct {
		public bool
		want   os.FileMode
	}{{false, 0o660}, {true, 0o666}} {
		dir := t.TempDir()
		cfg, err := ParseConfig([]byte(fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s/run/admin.sock, public_read: %v}\n", dir, dir, tt.public)))
		if err != nil {
			t.Fatal(err)
		}
		a := runAgentNoRoles(t, cfg)
		sock, _ := a.AdminSocket()
		fi, err := os.Stat(sock)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != tt.want {
			t.Errorf("public_read=%v: socket mode %o, want %o", tt.public, got, tt.want)
		}
	}
}

func runAgentNoRoles(t *testing.T, cfg *Config) *Agent {
	t.Helper()
	a := runAgent(t, cfg, Options{})
	waitFor(t, "the admin socket", func() bool { _, ok := a.AdminSocket(); return ok })
	return a
}

// TestRunFailsCleanlyAfterStarting: a failure late in start-up (here the
// metrics port is taken) returns the error and stops what already started,
// instead of waiting forever for it.
func TestRunFailsCleanlyAfterStarting(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	dir := t.TempDir()
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`
node: {name: a, state_dir: %s}
admin: {socket: %s/admin.sock, metrics: %q}
proxy: {health_interval: 20ms}
roles:
  chat: {port: 1, upstream: "http://127.0.0.1:9"}
`, dir, dir, taken.Addr().String())))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Roles["chat"]
	r.Port = 0
	cfg.Roles["chat"] = r
	a, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(context.Background()) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "admin.metrics") {
			t.Errorf("Run = %v, want the admin.metrics error", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after failing to bind admin.metrics")
	}
}
