package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/admin/admintest"
)

// TestRefusedSocketNamesTheGroup runs the CLI as another user (nobody)
// against a real agent socket that the kernel does not let it reach: the
// socket's directory shut to it, then the socket itself. It must say
// "permission denied: you are not in group X" with X the group stat sees
// on what refused, and exit 77 (a refused caller), not "agent
// unreachable (is infermeshd running?)" with 69. In that group the same
// command answers.
func TestRefusedSocketNamesTheGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test runs the CLI as another user: it needs root (CI runs as root)")
	}
	const nobody = 65534
	g, err := user.LookupGroup("daemon")
	if err != nil {
		t.Fatalf("the test's group: %v", err)
	}
	gid, _ := strconv.Atoi(g.Gid)
	cli := bins.Get(t)["infermesh"]
	base, err := os.MkdirTemp("", "infermesh-refused-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	serve := func(path string) {
		t.Helper()
		ln, err := admin.Listen(admin.ListenConfig{Path: path, Group: g.Name})
		if err != nil {
			t.Fatal(err)
		}
		srv, err := admin.New(admin.Config{Backend: admintest.New()})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- srv.Serve(ln) }()
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(ctx)
			<-done
		})
	}
	runAs := func(groups []uint32, args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(cli, args...)
		cmd.Dir = base
		cmd.Env = []string{"HOME=" + base, "PATH=/usr/bin:/bin"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody, Groups: groups}}
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errOut.String(), code
	}

	// The directory (created 0750, the group's) refuses.
	shutDir := filepath.Join(base, "run")
	sock := filepath.Join(shutDir, "admin.sock")
	serve(sock)
	// The socket itself refuses: its directory is open, the socket 0660.
	openDir := filepath.Join(base, "open")
	if err := os.Mkdir(openDir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock2 := filepath.Join(openDir, "admin.sock")
	serve(sock2)
	if err := os.Chmod(openDir, 0o755); err != nil { // Listen gave it the group's 0750
		t.Fatal(err)
	}

	for _, tt := range []struct {
		name, sock, denied, mode string
	}{
		{"directory", sock, shutDir, "drwxr-x---"},
		{"socket", sock2, sock2, "Srw-rw----"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, errOut, code := runAs(nil, "status", "--socket", tt.sock, "--wait", "0s")
			want := fmt.Sprintf("infermesh: permission denied: you are not in group daemon, which owns %s (%s root:daemon); an administrator adds you with: usermod -aG daemon nobody (then log in again)\n", tt.denied, tt.mode)
			if code != exitNoPerm || errOut != want {
				t.Errorf("status as nobody = exit %d, %q\nwant exit %d, %q", code, errOut, exitNoPerm, want)
			}
			_, errOut, code = runAs(nil, "status", "--socket", tt.sock, "--wait", "0s", "--json")
			var body struct {
				Error struct {
					Code     string `json:"code"`
					ExitCode int    `json:"exit_code"`
				} `json:"error"`
			}
			if err := json.Unmarshal([]byte(errOut), &body); err != nil || code != exitNoPerm || body.Error.Code != "forbidden" || body.Error.ExitCode != exitNoPerm {
				t.Errorf("status --json as nobody = exit %d, %q; want code forbidden, exit %d", code, errOut, exitNoPerm)
			}
			// In the group it names, the same user is answered.
			out, errOut, code := runAs([]uint32{uint32(gid)}, "status", "--socket", tt.sock, "--wait", "0s")
			if code != 0 || !strings.Contains(out, "v1.2.3") {
				t.Errorf("status as nobody in group daemon = exit %d, %q, %q; want the agent's answer", code, out, errOut)
			}
		})
	}
}

// TestRefusalWithTheConfigsAdminGroup: when this user may read the
// agent's config, a refusal says what its admin.group is.
func TestRefusalWithTheConfigsAdminGroup(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	refused := &admin.SocketRefusedError{Path: sock, Denied: dir, Mode: os.ModeDir | 0o750, Owner: "infermesh", Group: "infermesh", GID: 999, User: "alice"}
	for _, tt := range []struct{ group, want string }{
		{"", "sets no admin.group, so members of infermesh may only read"},
		{"infermesh", "it is admin.group in"},
		{"ops", "names admin.group ops"},
	} {
		cfg := filepath.Join(dir, "infermesh.yaml")
		if err := os.WriteFile(cfg, []byte(fmt.Sprintf("node: {name: a}\nadmin: {socket: %s, group: %q}\n", sock, tt.group)), 0o600); err != nil {
			t.Fatal(err)
		}
		got := explainRefusal(fmt.Errorf("wrapped: %w", refused), cfg)
		if !strings.HasPrefix(got.Error(), refused.Error()+"; ") || !strings.Contains(got.Error(), tt.want) || exitCode(got) != exitNoPerm {
			t.Errorf("admin.group %q: %q (exit %d); want the refusal, then %q, exit %d", tt.group, got, exitCode(got), tt.want, exitNoPerm)
		}
	}
	// Another socket's config says nothing about this one.
	if got := explainRefusal(refused, filepath.Join(dir, "none.yaml")); got.Error() != refused.Error() {
		t.Errorf("without a readable config: %q, want the refusal alone", got)
	}
}
