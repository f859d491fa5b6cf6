package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent"
)

// TestCLIAndAgentAgreeOnNodeNames: `authority issue --name N` issues a
// certificate exactly for the names an agent accepts as node.name. (They
// followed two rules once: the CLI allowed 64 bytes and any first
// character, the agent 63 starting with a letter or digit, so a
// certificate could be issued that no agent would start with.)
func TestCLIAndAgentAgreeOnNodeNames(t *testing.T) {
	dir := t.TempDir()
	ak := filepath.Join(dir, "authority.key")
	if _, errOut, code := runCLI(t, "authority", "init", "--key-file", ak); code != 0 {
		t.Fatalf("authority init exit %d: %s", code, errOut)
	}
	nodeOut, errOut, code := runCLI(t, "keygen", "--state-dir", filepath.Join(dir, "n"))
	if code != 0 {
		t.Fatalf("keygen exit %d: %s", code, errOut)
	}
	nodePub := strings.Fields(nodeOut)[0]
	names := []string{
		"a", "node-1", "n1.example_x", "9lives", "A.", "a..b",
		strings.Repeat("x", 63), strings.Repeat("x", 64),
		"-a", ".a", "_a", ".", "..", "a/b", "a b", "a=", "é",
	}
	for i, name := range names {
		_, _, code := runCLI(t, "authority", "issue", "--key-file", ak, "--name", name, "--public-key", nodePub, "--ttl", "1h")
		cliOK := code == 0
		cfg := filepath.Join(dir, fmt.Sprintf("c%d.yaml", i))
		yaml := fmt.Sprintf("node: {name: %q, state_dir: %q}\nroles:\n  chat: {port: 28100, upstream: \"http://127.0.0.1:8081\"}\n", name, filepath.Join(dir, "s"))
		if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := agent.LoadConfig(cfg)
		if agentOK := err == nil; cliOK != agentOK {
			t.Errorf("name %q: the CLI issues a certificate: %v; the agent accepts it as node.name: %v (%v)", name, cliOK, agentOK, err)
		}
	}
}
