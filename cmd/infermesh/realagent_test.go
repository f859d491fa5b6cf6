package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent"
	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// startRealAgent runs a real agent on the config file at path (Run opens
// and serves its admin socket); stop ends it.
func startRealAgent(t *testing.T, path string) (a *agent.Agent, stop func()) {
	t.Helper()
	cfg, err := agent.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	a, err = agent.New(cfg, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case err := <-done:
			cancel()
			t.Fatalf("Run: %v", err)
		default:
		}
		_, bound := a.RoleAddr("chat")
		if _, ok := a.AdminSocket(); ok && bound {
			break
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatal("agent did not open its admin socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	t.Cleanup(stop)
	return a, stop
}

func rolesJSON(t *testing.T, sock string) map[string]admin.Role {
	t.Helper()
	out, errOut, code := runCLI(t, "roles", "--json", "--socket", sock)
	if code != 0 {
		t.Fatalf("roles: exit %d: %s", code, errOut)
	}
	var rs []admin.Role
	if err := json.Unmarshal([]byte(out), &rs); err != nil {
		t.Fatal(err)
	}
	m := map[string]admin.Role{}
	for _, r := range rs {
		m[r.Name] = r
	}
	return m
}

func rules(rs []admin.Rule) string {
	var out []string
	for _, r := range rs {
		out = append(out, fmt.Sprintf("%s=%v/%s", r.Node, r.On, r.Source))
	}
	return strings.Join(out, " ")
}

// TestPolicySurvivesAgentRestart: policy set through the CLI is stored and
// applied again by a restarted agent, on top of the unchanged config.
func TestPolicySurvivesAgentRestart(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	port := testnet.TCPPort(t, "127.0.0.1")
	cfgPath := filepath.Join(dir, "infermesh.yaml")
	cfg := fmt.Sprintf(`
node: {name: a, state_dir: %s}
admin: {socket: %s}
roles:
  chat:
    port: %d
    accept_from: [b]
`, filepath.Join(dir, "state"), sock, port)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}

	a, stop := startRealAgent(t, cfgPath)
	for _, args := range [][]string{
		{"allow", "chat", "d"},
		{"deny", "chat", "b"},
		{"expose", "chat"},
		{"serve-to", "add", "chat", "e"},
	} {
		if out, errOut, code := runCLI(t, append(args, "--socket", sock)...); code != 0 {
			t.Fatalf("infermesh %v: exit %d: %s %s", args, code, out, errOut)
		}
	}
	if !a.Table().RemoteNodeAllowed("chat", "d") || a.Table().RemoteNodeAllowed("chat", "b") {
		t.Fatal("the CLI's changes did not reach the placement table")
	}
	stop()

	a, _ = startRealAgent(t, cfgPath)
	tb := a.Table()
	if !tb.RemoteNodeAllowed("chat", "d") || tb.RemoteNodeAllowed("chat", "b") || !tb.MeshPeerAllowed("chat", "e") ||
		len(tb.ExposedRoles()) != 1 {
		t.Fatalf("after restart the table lost the run-time policy: %+v", tb.Snapshot())
	}
	chat := rolesJSON(t, sock)["chat"]
	if got, want := rules(chat.AcceptFrom), "b=false/runtime d=true/runtime"; got != want {
		t.Errorf("accept_from after restart = %s, want %s", got, want)
	}
	if got, want := rules(chat.ServeTo), "e=true/runtime"; got != want {
		t.Errorf("serve_to after restart = %s, want %s", got, want)
	}
	if !chat.Expose.On || chat.Expose.Source != admin.SourceRuntime {
		t.Errorf("expose after restart = %+v, want on from runtime", chat.Expose)
	}

	// policy reset: the config decides again.
	if _, errOut, code := runCLI(t, "policy", "reset", "--socket", sock); code != 0 {
		t.Fatalf("policy reset: %s", errOut)
	}
	chat = rolesJSON(t, sock)["chat"]
	if got, want := rules(chat.AcceptFrom), "b=true/config"; got != want || chat.Expose.On {
		t.Errorf("after reset accept_from = %s (expose %v), want %s and not exposed", got, chat.Expose.On, want)
	}
}
