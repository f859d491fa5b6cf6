package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
)

var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "infermeshd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "infermeshd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// TestDevModeServesAndStopsCleanly is `make run`: the dev agent prints a
// curl line, streams a chat completion ending in [DONE], tells systemd it is
// ready, and exits 0 on SIGTERM.
func TestDevModeServesAndStopsCleanly(t *testing.T) {
	notify := filepath.Join(t.TempDir(), "notify.sock")
	nconn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notify, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer nconn.Close()

	port := testnet.TCPPort(t, "127.0.0.1")
	cmd := exec.Command(bin, "-dev", "-dev-port", fmt.Sprint(port), "-dev-token-delay", "1ms")
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+notify)
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan string, 256)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	want := fmt.Sprintf("curl -sN http://127.0.0.1:%d/v1/chat/completions", port)
	deadline := time.After(20 * time.Second)
	for found := false; !found; {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("infermeshd exited before printing the curl line")
			}
			found = strings.Contains(l, want)
			// The console format colours only a terminal; stderr is a pipe.
			if strings.Contains(l, "\x1b[") {
				t.Errorf("log line on a pipe has ANSI colours: %q", l)
			}
		case <-deadline:
			t.Fatalf("no %q line within 20s", want)
		}
	}

	// READY=1 is the first state; the role port's socket handed to
	// systemd's store (FDSTORE=1, see fdstore.go) may come before it.
	if got, _, err := readNotify(nconn, 5*time.Second); err != nil || got != "READY=1" {
		t.Errorf("sd_notify got %q, %v; want READY=1", got, err)
	}

	var resp *http.Response
	for i := 0; i < 100; i++ { // the demo instance registers after its first probe
		resp, err = http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", port), "application/json",
			strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
		if err == nil && resp.StatusCode == 200 {
			break
		}
		if resp != nil {
			resp.Body.Close()
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("chat: %v", err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.HasSuffix(string(raw), "data: [DONE]\n\n") || !strings.Contains(string(raw), `"model":"chat"`) {
		t.Errorf("stream = %q", raw)
	}

	go func() {
		for range lines {
		}
	}()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v, want a clean exit", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("infermeshd did not stop within 15s of SIGTERM")
	}
}

func TestConfigErrorsExitNonZero(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("node: {name: a}\nroles:\n  chat: {port: 1, upstrem: x}\n"), 0o600)
	tests := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-config", bad}, exitConfig, `line 3: unknown key "upstrem"`},
		{[]string{"-config", bad, "-validate"}, exitConfig, `line 3: unknown key "upstrem"`},
		{[]string{"-config", filepath.Join(dir, "missing.yaml")}, exitConfig, "no such file"},
		{[]string{"-dev", "-dev-port", "0"}, exitUsage, "roles.chat.port"},
		{[]string{"-bogus"}, exitUsage, "flag provided but not defined"},
		{[]string{"-config", bad, "extra"}, exitUsage, `unexpected argument "extra"`},
	}
	for _, tt := range tests {
		out, err := exec.Command(bin, tt.args...).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != tt.code {
			t.Errorf("%v: %v, want exit %d", tt.args, err, tt.code)
		}
		if !strings.Contains(string(out), tt.want) {
			t.Errorf("%v: output %q, want it to mention %q", tt.args, out, tt.want)
		}
	}
}

// TestValidate: -validate accepts a good config without starting anything.
func TestValidate(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	sock := filepath.Join(dir, "admin.sock")
	os.WriteFile(good, []byte("node: {name: a, state_dir: "+dir+"}\nadmin: {socket: "+sock+"}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:9'}\n"), 0o600)
	out, err := exec.Command(bin, "-validate", "-config", good).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "valid (node a, site default, 1 roles)") {
		t.Errorf("-validate: %v, %q; want exit 0 and a line saying it is valid", err, out)
	}
	if _, err := os.Stat(sock); err == nil {
		t.Error("-validate created the admin socket: it must not start the agent")
	}
}

// TestSIGHUPReloads changes the config under a running agent and checks the
// reload is applied (the role becomes exposed) without a restart.
func TestSIGHUPReloads(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "infermesh.yaml")
	sock := filepath.Join(dir, "admin.sock")
	port := testnet.TCPPort(t, "127.0.0.1")
	write := func(expose bool) {
		c := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nlog: {level: info}\nroles:\n  chat: {port: %d, upstream: 'http://127.0.0.1:9', expose: %v}\n", dir, sock, port, expose)
		if err := os.WriteFile(cfgPath, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(false)
	cmd := exec.Command(bin, "-config", cfgPath)
	var logs strings.Builder
	cmd.Stderr = &syncWriter{w: &logs}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}()
	waitLog := func(what string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for !strings.Contains(logsString(cmd), what) {
			if time.Now().After(deadline) {
				t.Fatalf("log never showed %q:\n%s", what, logsString(cmd))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitLog("infermeshd ready")
	write(true)
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitLog(`"msg":"reloaded"`)
	if s := logsString(cmd); !strings.Contains(s, "roles.chat.expose") {
		t.Errorf("reload log does not report the change:\n%s", s)
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

func logsString(cmd *exec.Cmd) string {
	sw := cmd.Stderr.(*syncWriter)
	sw.mu.Lock()
	defer sw.mu.Unlock()
	return sw.w.String()
}

// TestKeygenCreatesOnceAndPrintsThePublicKey: -keygen makes the node key in
// the config's state dir (0600), prints its public key, and prints the same
// key again without replacing it.
func TestKeygenCreatesOnceAndPrintsThePublicKey(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	cfg := filepath.Join(dir, "infermesh.yaml")
	if err := os.WriteFile(cfg, []byte("node: {name: k1, state_dir: "+state+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	run := func() string {
		out, err := exec.Command(bin, "-config", cfg, "-keygen").Output()
		if err != nil {
			t.Fatalf("infermeshd -keygen: %v", err)
		}
		return strings.TrimSpace(string(out))
	}
	first := run()
	st, err := os.Stat(filepath.Join(state, "node.key"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("node.key: %v, mode %v; want 0600", err, st)
	}
	if _, err := identity.ParseNodeKey(first); err != nil || !strings.HasPrefix(first, identity.NodeKeyPrefix) {
		t.Errorf("printed %q, want a node key (nodekey:<base64>): %v", first, err)
	}
	if second := run(); second != first {
		t.Errorf("second -keygen printed %q, want the same key %q", second, first)
	}
}
