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

// docBlocks returns the ```sh blocks of the section of the markdown file
// (a path from the repository's root) titled heading ("## Building a
// mesh"), in order. The section runs to the next heading of its level or
// above; lines inside fenced blocks are never headings.
func docBlocks(t *testing.T, file, heading string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("../..", file))
	if err != nil {
		t.Fatal(err)
	}
	level := strings.IndexByte(heading, ' ')
	if level < 1 || strings.Trim(heading[:level], "#") != "" {
		t.Fatalf("%q is not a markdown heading", heading)
	}
	var (
		blocks  []string
		found   bool
		block   []string
		inBlock bool // inside a ```sh block of the section
		fenced  bool // inside any fenced block
	)
	for _, line := range strings.Split(string(b), "\n") {
		if fenced {
			if line == "```" {
				fenced = false
				if inBlock {
					blocks = append(blocks, strings.Join(block, "\n"))
					block, inBlock = nil, false
				}
			} else if inBlock {
				block = append(block, line)
			}
			continue
		}
		if strings.HasPrefix(line, "```") {
			fenced = true
			inBlock = found && line == "```sh"
			continue
		}
		if line == heading {
			found = true
			continue
		}
		if found {
			if n := strings.IndexByte(line, ' '); n >= 1 && n <= level && strings.Trim(line[:n], "#") == "" {
				break
			}
		}
	}
	if !found {
		t.Fatalf("%s has no %q section", file, heading)
	}
	if fenced {
		t.Fatalf("an unterminated fenced block in %s", file)
	}
	return blocks
}

// runWalkthrough runs cmd (a bash running a walkthrough) in dir, in a
// process group of its own, and returns its output. Whatever happened, the
// group is killed when cmd returns: nothing of the walkthrough may be left
// running.
func runWalkthrough(cmd *exec.Cmd, dir string) (string, error) {
	cmd.Dir = dir
	cmd.WaitDelay = 10 * time.Second // a job holding the output open does not hold the test
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	return out.String(), err
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
	blocks := docBlocks(t, "README.md", "## Building a mesh")
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
	text, err := runWalkthrough(exec.CommandContext(ctx, "unshare", "--map-root-user", "--net", "bash", "-c", harness), work)
	if err != nil {
		t.Fatalf("the walkthrough failed: %v\n%s", err, text)
	}
	for _, want := range []string{"role chat is served by b", "data: [DONE]", "\n503\n"} {
		if !strings.Contains(text, want) {
			t.Errorf("the walkthrough's output lacks %q:\n%s", want, text)
		}
	}
}

// TestDocsManagedInstanceWalkthrough runs docs/operations.md's "A managed
// instance, end to end" blocks as written, one after the other in one
// bash at the repository's root, where its make demo-image builds bin/
// and the demo image, against the real Docker engine. What must hold:
// every step succeeds (set -euo pipefail), the instance is listed ready,
// the chat answer carries the role's name as its model, and the clean-up
// leaves neither a process nor the site's container behind (when a step
// fails, the test removes the site itself).
func TestDocsManagedInstanceWalkthrough(t *testing.T) {
	blocks := docBlocks(t, "docs/operations.md", "### A managed instance, end to end")
	if len(blocks) < 2 {
		t.Fatalf("found %d sh blocks in the walkthrough, want at least 2", len(blocks))
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	tmp := filepath.Join(work, "tmp") // the walkthrough's mktemp -d lands here
	if err := os.Mkdir(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(work, "walkthrough.sh")
	if err := os.WriteFile(script, []byte(strings.Join(blocks, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	harness := "trap 's=$?; kill $(jobs -p) 2>/dev/null || true; wait; exit $s' EXIT && source " + script
	cmd := exec.CommandContext(ctx, "bash", "-c", harness)
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
	text, err := runWalkthrough(cmd, root)
	// A walkthrough that stopped early left its site: its container
	// outlives the agent by design. Remove it as the walkthrough would.
	left, _ := filepath.Glob(filepath.Join(tmp, "*", "node.yaml"))
	for _, config := range left {
		del := exec.Command(filepath.Join(root, "bin", "infermesh"), "site", "delete", "--config", config)
		if b, derr := del.CombinedOutput(); derr != nil {
			t.Errorf("removing the site the walkthrough left (%s): %v\n%s", config, derr, b)
		}
	}
	if err != nil {
		t.Fatalf("the walkthrough failed: %v\n%s", err, text)
	}
	if len(left) > 0 {
		t.Errorf("the walkthrough succeeded but left %v behind", left)
	}
	// The site's container is named for site, node and role (demo, solo, chat).
	ps, err := exec.Command("docker", "ps", "-aq", "--filter", "name=^infermesh-demo-solo-chat-").Output()
	if err != nil {
		t.Errorf("docker ps: %v", err)
	} else if ids := strings.TrimSpace(string(ps)); ids != "" {
		t.Errorf("the clean-up left the site's container behind: %s", ids)
	}
	for _, want := range []string{"ready", `"model":"chat"`} {
		if !strings.Contains(text, want) {
			t.Errorf("the walkthrough's output lacks %q:\n%s", want, text)
		}
	}
}
