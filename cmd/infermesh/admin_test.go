package main

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/admin/admintest"
	"github.com/infermesh/infermesh/internal/testing/leakcheck"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

func TestMain(m *testing.M) {
	code := m.Run()
	nodeTeardown()
	bins.Remove()
	code = leakcheck.Check(code)
	os.Exit(code)
}

// fakeAgent serves fake on a fresh socket and returns the socket path.
func fakeAgent(t *testing.T, fake *admintest.Fake) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := admin.Listen(admin.ListenConfig{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := admin.New(admin.Config{Backend: fake})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return path
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("output differs from %s (go test -update rewrites it)\n--- got\n%s--- want\n%s", path, got, want)
	}
}

func TestGoldenOutput(t *testing.T) {
	now = func() time.Time { return admintest.T0 }
	t.Cleanup(func() { now = time.Now })
	events := []admin.Event{
		{Time: admintest.T0, Kind: "infer.remote.allow", Role: "chat", Node: "b", Fields: map[string]string{"allowed": "true", "consumer": "a"}},
		{Time: admintest.T0.Add(time.Second), Kind: "admin.refused", Fields: map[string]string{"why": "uid 1000 may only read", "request": "POST /v0/policy"}},
	}
	tests := []struct {
		name string
		args []string
	}{
		{"status", []string{"status"}},
		{"peers", []string{"peers"}},
		{"roles", []string{"roles"}},
		{"route", []string{"route", "chat"}},
		{"allow", []string{"allow", "chat", "d"}},
		{"deny", []string{"deny", "chat", "c"}},
		{"serve-to-add", []string{"serve-to", "add", "chat", "c"}},
		{"serve-to-remove", []string{"serve-to", "remove", "chat", "b"}},
		{"expose", []string{"expose", "embed"}},
		{"unexpose", []string{"unexpose", "chat"}},
		{"revoke", []string{"revoke", "x"}},
		{"unrevoke", []string{"unrevoke", "x"}},
		{"policy-list-empty", []string{"policy", "list"}},
		{"policy-reset-none", []string{"policy", "reset", "--role", "chat"}},
		{"keyring", []string{"keyring", "list"}},
		{"keyring-install", []string{"keyring", "install", "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI="}},
		{"events", []string{"events", "-n", "2"}},
		{"events-last", []string{"events", "-n", "1"}},
		{"reload", []string{"reload"}},
		{"instances", []string{"instances"}},
		{"instance-logs", []string{"instances", "logs", "embed", "-n", "5"}},
		{"instance-stop", []string{"instances", "stop", "embed"}},
		{"mesh", []string{"mesh"}},
	}
	for _, tt := range tests {
		for _, asJSON := range []bool{false, true} {
			name := tt.name
			args := tt.args
			if asJSON {
				name += ".json"
				args = append(append([]string(nil), args...), "--json")
			}
			t.Run(name, func(t *testing.T) {
				sock := fakeAgent(t, admintest.New(events...))
				out, errOut, code := runCLI(t, append(args, "--socket", sock)...)
				if code != 0 {
					t.Fatalf("infermesh %v: exit %d: %s", args, code, errOut)
				}
				golden(t, name, out)
			})
		}
	}
}

// TestPolicyListAfterChanges checks the override table after changes.
func TestPolicyListAfterChanges(t *testing.T) {
	sock := fakeAgent(t, admintest.New())
	for _, args := range [][]string{{"deny", "chat", "c"}, {"serve-to", "add", "chat", "e"}, {"revoke", "x"}} {
		if _, errOut, code := runCLI(t, append(args, "--socket", sock)...); code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, errOut)
		}
	}
	out, _, code := runCLI(t, "policy", "list", "--socket", sock)
	if code != 0 {
		t.Fatal("policy list failed")
	}
	golden(t, "policy-list", out)
	out, _, _ = runCLI(t, "policy", "reset", "--socket", sock)
	golden(t, "policy-reset", out)
}

func TestFailuresExitNonZero(t *testing.T) {
	fake := admintest.New()
	fake.NoMesh = true
	sock := fakeAgent(t, fake)
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown role", []string{"route", "nope", "--socket", sock}, `infermesh: role "nope" is not configured on this node`},
		{"no mesh", []string{"keyring", "list", "--socket", sock}, "infermesh: the mesh is not configured on this node"},
		{"no agent", []string{"status", "--wait", "0s", "--socket", filepath.Join(t.TempDir(), "none.sock")}, "infermesh: agent unreachable"},
		{"bad args", []string{"allow", "chat", "--socket", sock}, `allow needs a NODE after "chat": infermesh allow ROLE NODE`},
		{"metrics json", []string{"metrics", "--json", "--socket", sock}, "--json does not apply"},
		{"retry a serving instance", []string{"instances", "retry", "embed", "--socket", sock}, "instance has not failed"},
		{"retry no instance", []string{"instances", "retry", "nope", "--socket", sock}, `no managed instance for role "nope"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, errOut, code := runCLI(t, tt.args...)
			if code == 0 {
				t.Fatalf("infermesh %v: exit 0 (%q), want a failure", tt.args, out)
			}
			if !strings.Contains(errOut, tt.want) {
				t.Errorf("stderr = %q, want it to contain %q", errOut, tt.want)
			}
		})
	}
}

func TestSocketFromEnvAndWait(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "late.sock")
	t.Setenv("INFERMESH_SOCKET", sock)
	// The agent comes up a moment after the CLI starts: the CLI waits.
	srv, err := admin.New(admin.Config{Backend: admintest.New()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		time.Sleep(150 * time.Millisecond)
		ln, err := admin.Listen(admin.ListenConfig{Path: sock})
		if err != nil {
			done <- err
			return
		}
		done <- srv.Serve(ln)
	}()
	out, errOut, code := runCLI(t, "status", "--wait", "10s")
	_ = srv.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if code != 0 || !strings.Contains(out, "v1.2.3") {
		t.Errorf("status via INFERMESH_SOCKET = exit %d, %q, %q", code, out, errOut)
	}
}

func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish"} {
		out, errOut, code := runCLI(t, "completion", shell)
		if code != 0 || !strings.Contains(out, "infermesh") {
			t.Errorf("completion %s: exit %d, %d bytes, %s", shell, code, len(out), errOut)
		}
	}
	// Dynamic completion of a subcommand works through cobra's __complete.
	out, _, code := runCLI(t, "__complete", "keyr")
	if code != 0 || !strings.Contains(out, "keyring") {
		t.Errorf("__complete keyr = %q (exit %d), want keyring", out, code)
	}
}
