package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin/admintest"
	"github.com/infermesh/infermesh/identity"
)

// TestNodeGoldenOutput pins `node list`, and the progress of `node add` and
// `node remove` as text and as NDJSON (served by the fake backend).
func TestNodeGoldenOutput(t *testing.T) {
	key := filepath.Join(t.TempDir(), "authority.key")
	if _, err := identity.WriteNewKey(key); err != nil {
		t.Fatal(err)
	}
	add := []string{"node", "add", "gpu-7", "--ssh", "root@10.0.0.7", "--host-key-fingerprint", "SHA256:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU",
		"--roles", "chat", "--upstream", "chat=http://127.0.0.1:8081", "--authority-key", key}
	for _, tt := range []struct {
		name string
		args []string
	}{
		{"node-list", []string{"node", "list"}},
		{"node-add", add},
		{"node-remove", []string{"node", "remove", "gpu-7"}},
	} {
		for _, asJSON := range []bool{false, true} {
			name, args := tt.name, tt.args
			if asJSON {
				name += ".json"
				args = append(append([]string(nil), args...), "--json")
			}
			t.Run(name, func(t *testing.T) {
				sock := fakeAgent(t, admintest.New())
				out, errOut, code := runCLI(t, append(args, "--socket", sock)...)
				if code != 0 {
					t.Fatalf("infermesh %v: exit %d: %s", args, code, errOut)
				}
				golden(t, name, out)
			})
		}
	}
}

// TestNodeAddFailureExitsNonZero: a failed add exits 1 and says which
// node, which stage and why; a refused one says why.
func TestNodeAddFailureExitsNonZero(t *testing.T) {
	key := filepath.Join(t.TempDir(), "authority.key")
	if _, err := identity.WriteNewKey(key); err != nil {
		t.Fatal(err)
	}
	sock := fakeAgent(t, admintest.New())
	for name, want := range map[string]string{
		"fail":  "infermesh: node fail: add failed at stage boot_check_failed: boot check failed: systemd: the host does not run systemd (exit 1)\n",
		"taken": "infermesh: node taken: add: node exists: node taken is recorded (phase converged); `infermesh node remove taken` first\n",
	} {
		_, errOut, code := runCLI(t, "node", "add", name, "--provider", "docker", "--roles", "chat", "--demo", "--authority-key", key, "--socket", sock)
		if code != 1 || errOut != want {
			t.Errorf("node add %s: exit %d, stderr %q; want 1 and %q", name, code, errOut, want)
		}
	}
	_, errOut, code := runCLI(t, "node", "remove", "nope", "--socket", sock)
	if code != 1 || !strings.Contains(errOut, "no node nope is recorded") {
		t.Errorf("node remove nope: exit %d, stderr %q", code, errOut)
	}
	// Flags are checked before the agent is asked.
	for _, args := range [][]string{
		{"node", "add", "x", "--roles", "chat", "--authority-key", key},
		{"node", "add", "x", "--ssh", "root@10.9.9.9", "--known-hosts", filepath.Join(t.TempDir(), "none"), "--roles", "chat", "--authority-key", key},
		{"node", "add", "x", "--provider", "docker", "--roles", "chat", "--upstream", "embed=http://127.0.0.1:1", "--authority-key", key},
		{"node", "add", "x", "--provider", "docker", "--roles", "chat", "--authority-key", filepath.Join(t.TempDir(), "missing.key")},
	} {
		if _, errOut, code := runCLI(t, append(args, "--socket", sock)...); code != 1 || errOut == "" {
			t.Errorf("%v: exit %d %q, want a refusal", args, code, errOut)
		}
	}
}
