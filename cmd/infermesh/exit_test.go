package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/admin/admintest"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// TestExitCodes: scripts tell a typo, an agent that is down and a refusal
// apart by the exit code, and --json errors are one JSON object.
func TestExitCodes(t *testing.T) {
	sock := fakeAgent(t, admintest.New())
	missing := filepath.Join(t.TempDir(), "none.sock")
	tests := []struct {
		name     string
		args     []string
		code     int
		errCode  string
		contains string
	}{
		{"unknown command", []string{"frobnicate"}, exitUsage, "usage", "unknown command"},
		{"unknown flag", []string{"status", "--frob"}, exitUsage, "usage", "unknown flag"},
		{"too many args", []string{"route", "a", "b", "--socket", sock}, exitUsage, "usage", `route takes only ROLE (got 2 arguments: "a" "b"): infermesh route ROLE`},
		{"missing required flag", []string{"authority", "issue", "--name", "x"}, exitUsage, "usage", "required flag"},
		{"negative -n", []string{"events", "-n", "-1", "--socket", sock}, exitUsage, "usage", "-n -1"},
		{"agent down", []string{"status", "--socket", missing, "--wait", "0s"}, exitUnavailable, "unreachable", "is infermeshd running"},
		{"agent says not found", []string{"instances", "retry", "nope", "--socket", sock}, exitFailure, "not_found", "no managed instance"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, errOut, code := runCLI(t, tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.contains) || !strings.HasPrefix(errOut, "infermesh: ") {
				t.Errorf("infermesh %v = exit %d, stderr %q; want exit %d and a line with %q", tt.args, code, errOut, tt.code, tt.contains)
			}
			out, errOut, code := runCLI(t, append(tt.args, "--json")...)
			var body struct {
				Error struct {
					Code     string `json:"code"`
					Message  string `json:"message"`
					ExitCode int    `json:"exit_code"`
				} `json:"error"`
			}
			if err := json.Unmarshal([]byte(errOut), &body); err != nil {
				t.Fatalf("--json stderr %q is not JSON: %v", errOut, err)
			}
			if code != tt.code || body.Error.ExitCode != tt.code || body.Error.Code != tt.errCode || !strings.Contains(body.Error.Message, tt.contains) || out != "" {
				t.Errorf("--json: exit %d, stdout %q, error %+v; want exit %d, code %q, a message with %q", code, out, body.Error, tt.code, tt.errCode, tt.contains)
			}
		})
	}
}

func TestInstancesNoneExitsZero(t *testing.T) {
	f := admintest.New()
	f.NoInstances = true
	sock := fakeAgent(t, f)
	out, errOut, code := runCLI(t, "instances", "--socket", sock)
	if code != 0 || out != "no managed instances\n" {
		t.Errorf("instances without provisioning = exit %d, %q, %q; want 0 and a line saying there are none", code, out, errOut)
	}
	out, _, code = runCLI(t, "instances", "--socket", sock, "--json")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Errorf("instances --json without provisioning = exit %d, %q; want 0 and []", code, out)
	}
}

// TestEventsFollow: without -f events prints the history and exits (the
// golden tests); with -f it stays until interrupted, and -n still limits
// the history it starts with.
func TestEventsFollow(t *testing.T) {
	f := admintest.New(
		admin.Event{Time: admintest.T0, Kind: "one"},
		admin.Event{Time: admintest.T0, Kind: "two"},
		admin.Event{Time: admintest.T0, Kind: "three"},
	)
	f.HistorySent = make(chan struct{})
	sock := fakeAgent(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut testproc.SyncBuffer
	done := make(chan int, 1)
	go func() { done <- runContext(ctx, []string{"events", "-f", "-n", "2", "--socket", sock}, &out, &errOut) }()
	select {
	case <-f.HistorySent:
	case code := <-done:
		t.Fatalf("events -f ended (exit %d) before the history was sent: %s", code, errOut.String())
	case <-time.After(30 * time.Second):
		t.Fatal("events -f: no history within 30s")
	}
	// The stream is open: the CLI is still following. Wait for both lines.
	deadline := time.Now().Add(30 * time.Second)
	for strings.Count(out.String(), "\n") < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case code := <-done:
		t.Fatalf("events -f exited (%d) while the agent was still streaming", code)
	default:
	}
	cancel() // Ctrl-C
	select {
	case code := <-done:
		if code != 0 {
			t.Errorf("events -f interrupted = exit %d (%s), want 0", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("events -f did not end after the interrupt")
	}
	if got := out.String(); strings.Contains(got, " one") || !strings.Contains(got, " two") || !strings.Contains(got, " three") {
		t.Errorf("events -f -n 2 printed %q, want the last two events (two, three)", got)
	}
}

func TestVersion(t *testing.T) {
	sock := fakeAgent(t, admintest.New())
	out, errOut, code := runCLI(t, "version", "--socket", sock, "--json")
	var v versionInfo
	if err := json.Unmarshal([]byte(out), &v); code != 0 || err != nil {
		t.Fatalf("version --json = exit %d, %q, %q: %v", code, out, errOut, err)
	}
	st, _ := admintest.New().Status(context.Background())
	if v.CLI == "" || v.Agent != st.Version {
		t.Errorf("version = %+v, want the CLI's and the agent's (%q)", v, st.Version)
	}
	// No agent: the CLI's version, exit 0, and why the agent's is missing.
	missing := filepath.Join(t.TempDir(), "x.sock")
	out, _, code = runCLI(t, "version", "--socket", missing, "--wait", "0s")
	// Said once, the socket named once: not "unreachable: agent
	// unreachable: PATH: dial unix PATH: ...".
	want := "\nagent     agent unreachable: no socket at " + missing + " (is infermeshd running? use --socket or INFERMESH_SOCKET)\n"
	if code != 0 || !strings.HasPrefix(out, "infermesh ") || !strings.HasSuffix(out, want) {
		t.Errorf("version without an agent = exit %d, %q; want 0, the CLI's version and the line %q", code, out, want)
	}
	_, errOut, code = runCLI(t, "status", "--socket", missing, "--wait", "0s")
	if want := "infermesh: agent unreachable: no socket at " + missing + " (is infermeshd running? use --socket or INFERMESH_SOCKET)\n"; code != exitUnavailable || errOut != want {
		t.Errorf("status without an agent = exit %d, %q; want %d, %q", code, errOut, exitUnavailable, want)
	}
}
