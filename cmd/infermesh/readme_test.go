package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readmeBlocks returns the ```sh blocks of README.md's section titled
// heading, in order.
func readmeBlocks(t *testing.T, heading string) []string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("README.md has no %q section", heading)
	}
	if i := strings.Index(section, "\n## "); i >= 0 {
		section = section[:i]
	}
	var blocks []string
	for {
		_, rest, ok := strings.Cut(section, "\n```sh\n")
		if !ok {
			return blocks
		}
		block, after, ok := strings.Cut(rest, "\n```\n")
		if !ok {
			t.Fatalf("an unterminated ```sh block in %q", heading)
		}
		blocks = append(blocks, block)
		section = after
	}
}

// TestREADMEMeshWalkthrough runs README.md's "Building a mesh" blocks as
// written, one after the other in one bash, with the binaries of make
// build in bin/. It runs in a network namespace of its own (its fixed
// addresses and ports cannot meet another test's); only its loopback is
// brought up first. What must hold: every step succeeds (set -euo pipefail
// is the walkthrough's first line), the chat streams to [DONE] through b,
// the deny answers 503, and the clean-up leaves no process behind.
func TestREADMEMeshWalkthrough(t *testing.T) {
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Fatalf("unshare (util-linux) is needed to give the walkthrough its own network: %v", err)
	}
	blocks := readmeBlocks(t, "## Building a mesh")
	if len(blocks) < 4 {
		t.Fatalf("found %d sh blocks in the walkthrough, want at least 4", len(blocks))
	}
	built := bins.Get(t)
	work := t.TempDir()
	if err := os.Mkdir(filepath.Join(work, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"infermesh", "infermeshd", "infermesh-demo"} {
		path := built[name]
		if err := os.Symlink(path, filepath.Join(work, "bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	script := filepath.Join(work, "walkthrough.sh")
	if err := os.WriteFile(script, []byte(strings.Join(blocks, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// The harness around the script: a loopback, and, when a step fails
	// (set -e ends the script early), its background jobs stopped.
	harness := "ip link set lo up && trap 's=$?; kill $(jobs -p) 2>/dev/null || true; exit $s' EXIT && source " + script
	cmd := exec.CommandContext(ctx, "unshare", "--map-root-user", "--net", "bash", "-c", harness)
	cmd.WaitDelay = 10 * time.Second // a job holding the output open does not hold the test
	cmd.Dir = work
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	// Whatever happened, nothing of the walkthrough may be left running.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	text := out.String()
	if err != nil {
		t.Fatalf("the walkthrough failed: %v\n%s", err, text)
	}
	for _, want := range []string{"role chat is served by b", "data: [DONE]", "\n503\n"} {
		if !strings.Contains(text, want) {
			t.Errorf("the walkthrough's output lacks %q:\n%s", want, text)
		}
	}
}
