package admin_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/admin/admintest"
)

const helperEnv = "INFERMESH_ADMIN_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		os.Exit(helperMain())
	}
	goleak.VerifyTestMain(m)
}

// helperMain runs as another user: it tries a read, a change and the
// keyring on the socket and prints what happened, one "op=result" a line.
func helperMain() int {
	c := admin.NewClient(os.Getenv("INFERMESH_SOCKET"), admin.ClientOptions{Wait: -1})
	defer c.Close()
	ctx := context.Background()
	result := func(err error) string {
		var ae *admin.APIError
		switch {
		case err == nil:
			return "ok"
		case errors.As(err, &ae):
			return ae.Code
		default:
			return "error: " + err.Error()
		}
	}
	_, err := c.Status(ctx)
	fmt.Printf("status=%s\n", result(err))
	_, err = c.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "chat", Node: "b", On: true})
	fmt.Printf("set_policy=%s\n", result(err))
	_, err = c.Reload(ctx)
	fmt.Printf("reload=%s\n", result(err))
	k, err := c.Keyring(ctx)
	fmt.Printf("keyring=%s\n", result(err))
	fmt.Printf("keyring_secret=%v\n", err == nil && k.Keys[0].Key != "")
	k, err = c.KeyringSecrets(ctx)
	fmt.Printf("keyring_secrets=%s\n", result(err))
	fmt.Printf("keyring_secrets_key=%v\n", err == nil && k.Keys[0].Key != "")
	return 0
}

type testServer struct {
	path string
	srv  *admin.Server
	fake *admintest.Fake
	done chan error
}

// serve starts a Server over fake on a socket in a fresh directory.
func serve(t *testing.T, fake *admintest.Fake, cfg admin.Config) *testServer {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "admin.sock")
	ln, err := admin.Listen(admin.ListenConfig{Path: path, Group: cfg.Group})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Backend = fake
	srv, err := admin.New(cfg)
	if err != nil {
		_ = ln.Close()
		t.Fatal(err)
	}
	ts := &testServer{path: path, srv: srv, fake: fake, done: make(chan error, 1)}
	go func() { ts.done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-ts.done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ts
}

func (ts *testServer) client(t *testing.T) *admin.Client {
	t.Helper()
	c := admin.NewClient(ts.path, admin.ClientOptions{Wait: -1})
	t.Cleanup(c.Close)
	return c
}

func TestReadsAndChangesAsRoot(t *testing.T) {
	ts := serve(t, admintest.New(), admin.Config{})
	c := ts.client(t)
	ctx := context.Background()

	st, err := c.Status(ctx)
	if err != nil || st.Node != "a" || st.Generation != 42 {
		t.Fatalf("Status() = %+v, %v", st, err)
	}
	res, err := c.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindServeTo, Role: "chat", Node: "c", On: true})
	if err != nil || !res.Changed {
		t.Fatalf("SetPolicy() = %+v, %v", res, err)
	}
	if got, want := ts.fake.Calls(), []string{"uid=0 policy serve_to chat c true"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("backend calls = %q, want %q", got, want)
	}
	// The keys themselves only when asked for, even by root.
	k, err := c.Keyring(ctx)
	if err != nil || len(k.Keys) != 2 || k.Keys[0].Key != "" || k.Keys[0].Fingerprint == "" {
		t.Errorf("Keyring() as root = %+v, %v; want fingerprints and no key", k, err)
	}
	// Not sent at all: the bytes on the socket hold no key.
	raw := rawBody(t, ts.path, "/v0/keyring")
	full, _ := ts.fake.Keyring(ctx)
	for _, g := range full.Keys {
		if !strings.Contains(raw, g.Fingerprint) || strings.Contains(raw, g.Key) {
			t.Errorf("GET /v0/keyring = %s; want fingerprint %s and not the key", raw, g.Fingerprint)
		}
	}
	k, err = c.KeyringSecrets(ctx)
	if err != nil || k.Keys[0].Key == "" {
		t.Errorf("KeyringSecrets() as root = %+v, %v; want the keys themselves", k, err)
	}
	kc, err := c.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringInstall, Key: "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI="})
	if err != nil || len(kc.Keys) == 0 || kc.Keys[0].Key != "" {
		t.Errorf("ChangeKeyring() = %+v, %v; want the keyring by fingerprint, no key sent back", kc, err)
	}
	logs, err := c.InstanceLogs(ctx, "embed", 1)
	if err != nil || len(logs) != 1 || logs[0].Line != "listening on :8080" {
		t.Errorf("InstanceLogs(embed, 1) = %+v, %v", logs, err)
	}
}

func TestErrorsKeepTheirMeaning(t *testing.T) {
	fake := admintest.New()
	fake.NoMesh = true
	ts := serve(t, fake, admin.Config{})
	c := ts.client(t)
	ctx := context.Background()
	tests := []struct {
		name string
		call func() error
		want error
		code int
	}{
		{"unknown role", func() error { _, err := c.Route(ctx, "nope"); return err }, admin.ErrNotFound, 404},
		{"bad kind", func() error {
			_, err := c.SetPolicy(ctx, admin.PolicyChange{Kind: "bogus"})
			return err
		}, admin.ErrInvalid, 400},
		{"no mesh", func() error { _, err := c.Keyring(ctx); return err }, admin.ErrNotConfigured, 503},
		{"bad keyring op", func() error {
			_, err := c.ChangeKeyring(ctx, admin.KeyringChange{Op: "shuffle"})
			return err
		}, admin.ErrNotFound, 404},
		{"no metrics", func() error { _, err := c.Metrics(ctx); return err }, admin.ErrNotConfigured, 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			var ae *admin.APIError
			if !errors.Is(err, tt.want) || !errors.As(err, &ae) || ae.Status != tt.code {
				t.Errorf("err = %v (%T), want %v with status %d", err, err, tt.want, tt.code)
			}
		})
	}
}

// rawRequest sends one request over the socket with the given headers.
func rawRequest(t *testing.T, path, method, target string, hdr map[string]string) int {
	t.Helper()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req, _ := http.NewRequest(method, "http://"+admin.Host+target, strings.NewReader("{}"))
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// rawBody is the body of GET target on the socket, as sent.
func rawBody(t *testing.T, path, target string) string {
	t.Helper()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req, _ := http.NewRequest(http.MethodGet, "http://"+admin.Host+target, nil)
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCrossOriginAndHostRefused(t *testing.T) {
	var refused []string
	ts := serve(t, admintest.New(), admin.Config{OnRefused: func(c admin.Caller, method, path, why string) {
		refused = append(refused, method+" "+path)
	}})
	tests := []struct {
		name string
		hdr  map[string]string
		want int
	}{
		{"plain", nil, 200},
		{"origin", map[string]string{"Origin": "http://evil.example"}, 403},
		{"referer", map[string]string{"Referer": "http://evil.example/x"}, 403},
		{"other host", map[string]string{"Host": "localhost"}, 403},
		{"rebound host", map[string]string{"Host": "evil.example:80"}, 403},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := rawRequest(t, ts.path, "GET", "/v0/status", tt.hdr); got != tt.want {
				t.Errorf("GET /v0/status with %v = %d, want %d", tt.hdr, got, tt.want)
			}
		})
	}
	if got := rawRequest(t, ts.path, "POST", "/v0/policy", map[string]string{"Origin": "null"}); got != 403 {
		t.Errorf("POST /v0/policy with Origin = %d, want 403", got)
	}
	if len(ts.fake.Calls()) != 0 {
		t.Errorf("a refused change reached the backend: %v", ts.fake.Calls())
	}
	if len(refused) != 5 {
		t.Errorf("OnRefused saw %v, want 5 refusals", refused)
	}
}

// runAs runs this test binary's helper as uid/gid (with extra groups)
// against the socket and returns its "op=result" lines.
func runAs(t *testing.T, socket string, uid, gid uint32, groups ...uint32) map[string]string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test runs the client as another user and needs root (CI runs as root)")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The go test binary lives in a private build dir: copy it where the
	// other user can execute it.
	dir, err := os.MkdirTemp("", "admin-helper-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "helper")
	data, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Dir = dir
	cmd.Env = []string{helperEnv + "=1", "INFERMESH_SOCKET=" + socket, "HOME=" + dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: groups}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as uid %d: %v\n%s", uid, err, out)
	}
	res := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		k, v, _ := strings.Cut(line, "=")
		res[k] = v
	}
	return res
}

// openSocket lets any user reach the socket: the test's other uid is not
// in the group and not the owner.
func openSocket(t *testing.T, path string) {
	t.Helper()
	if err := os.Chmod(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	// t.TempDir's parent is private too.
	if err := os.Chmod(filepath.Dir(filepath.Dir(path)), 0o755); err != nil {
		t.Fatal(err)
	}
}

func TestOtherUserMayOnlyRead(t *testing.T) {
	ts := serve(t, admintest.New(), admin.Config{Group: "4242"})
	openSocket(t, ts.path)
	got := runAs(t, ts.path, 65534, 65534)
	want := map[string]string{
		"status":              "ok",
		"set_policy":          "forbidden",
		"reload":              "forbidden",
		"keyring":             "ok",
		"keyring_secret":      "false",
		"keyring_secrets":     "forbidden",
		"keyring_secrets_key": "false",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("as uid 65534: %s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
	if calls := ts.fake.Calls(); len(calls) != 0 {
		t.Errorf("read-only user's changes reached the backend: %v", calls)
	}
}

func TestAdminGroupMayChange(t *testing.T) {
	ts := serve(t, admintest.New(), admin.Config{Group: "4242"})
	openSocket(t, ts.path)
	// In the group through a supplementary group only.
	got := runAs(t, ts.path, 65534, 65534, 4242)
	for k, v := range map[string]string{"status": "ok", "set_policy": "ok", "reload": "ok", "keyring_secret": "false", "keyring_secrets": "ok", "keyring_secrets_key": "true"} {
		if got[k] != v {
			t.Errorf("as uid 65534 in group 4242: %s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
	calls := ts.fake.Calls()
	if len(calls) != 2 || !strings.HasPrefix(calls[0], "uid=65534 policy accept_from chat b true") {
		t.Errorf("backend calls = %q, want the group member's policy change and reload", calls)
	}
}

func TestListenModes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run", "infermesh")
	path := filepath.Join(dir, "admin.sock")
	ln, err := admin.Listen(admin.ListenConfig{Path: path, Group: "4242"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, c := range []struct {
		path string
		mode os.FileMode
	}{{dir, 0o750}, {path, 0o660}} {
		st, err := os.Stat(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if got := st.Mode().Perm(); got != c.mode {
			t.Errorf("mode of %s = %v, want %v", c.path, got, c.mode)
		}
		if gid := st.Sys().(*syscall.Stat_t).Gid; gid != 4242 {
			t.Errorf("group of %s = %d, want 4242", c.path, gid)
		}
	}
}

func TestStaleSocketRemovedLiveRefused(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "admin.sock")

	// A stale socket: bound, then the process "died" without removing it.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("stale socket file missing: %v", err)
	}
	ln, err := admin.Listen(admin.ListenConfig{Path: path})
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}

	// A live one: a second Listen refuses and leaves it working.
	if _, err := admin.Listen(admin.ListenConfig{Path: path}); !errors.Is(err, admin.ErrInUse) {
		t.Fatalf("second Listen = %v, want ErrInUse", err)
	}
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_ = c.Close()
		}
		accepted <- err
	}()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the live socket stopped working: %v", err)
	}
	_ = conn.Close()
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	_ = ln.Close()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after Close: %v, want removed", err)
	}

	// Not a socket: never removed.
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Listen(admin.ListenConfig{Path: path}); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("Listen over a regular file = %v, want a 'not a socket' error", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("regular file removed: %v", err)
	}
}

func TestEventsStreamAndShutdown(t *testing.T) {
	fake := admintest.New(
		admin.Event{Time: admintest.T0, Kind: "infer.remote.allow", Role: "chat", Node: "b", Fields: map[string]string{"allowed": "true"}},
		admin.Event{Time: admintest.T0, Kind: "admin.reload"},
	)
	fake.HistorySent = make(chan struct{})
	ts := serve(t, fake, admin.Config{})
	c := ts.client(t)

	var got []admin.Event
	errc := make(chan error, 1)
	go func() {
		errc <- c.Events(context.Background(), admin.EventsOptions{Follow: true}, func(e admin.Event) error { got = append(got, e); return nil })
	}()
	<-fake.HistorySent
	// Shutdown ends the stream instead of waiting for it.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ts.srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown with a follower: %v", err)
	}
	if err := <-errc; !errors.Is(err, admin.ErrStreamEnded) {
		t.Errorf("Events after Shutdown = %v, want ErrStreamEnded", err)
	}
	if len(got) != 2 || got[0].Kind != "infer.remote.allow" || got[0].Fields["allowed"] != "true" {
		b, _ := json.Marshal(got)
		t.Errorf("events = %s", b)
	}
}

func TestClientWaitsForTheAgent(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "admin.sock")
	c := admin.NewClient(path, admin.ClientOptions{Wait: 5 * time.Second})
	defer c.Close()
	srv, err := admin.New(admin.Config{Backend: admintest.New()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		time.Sleep(100 * time.Millisecond) // the agent is still starting
		ln, err := admin.Listen(admin.ListenConfig{Path: path})
		if err != nil {
			done <- err
			return
		}
		done <- srv.Serve(ln)
	}()
	if _, err := c.Status(context.Background()); err != nil {
		t.Errorf("Status while the agent starts: %v", err)
	}
	_ = srv.Close()
	if err := <-done; err != nil {
		t.Error(err)
	}

	quick := admin.NewClient(filepath.Join(dir, "missing.sock"), admin.ClientOptions{Wait: -1})
	defer quick.Close()
	if _, err := quick.Status(context.Background()); !errors.Is(err, admin.ErrUnreachable) {
		t.Errorf("Status without an agent = %v, want ErrUnreachable", err)
	}
}
