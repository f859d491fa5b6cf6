package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testnet"
)

// TestOneFingerprintPerGossipKey: for one gossip key, the CLI (through the
// agent's keyring view) and the mesh show the same fingerprint, the one
// identity.GossipKeyFingerprint gives, and the CLI can name the key by it.
func TestOneFingerprintPerGossipKey(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	kr := filepath.Join(state, "keyring.json")
	out, errOut, code := runCLI(t, "keygen", "--gossip", "--keyring", kr, "--json")
	if code != 0 {
		t.Fatalf("keygen --gossip: exit %d: %s", code, errOut)
	}
	var made keyResult
	if err := json.Unmarshal([]byte(out), &made); err != nil {
		t.Fatal(err)
	}
	// The key stays in the keyring file; the CLI printed its fingerprint.
	written, err := identity.LoadKeyring(kr)
	if err != nil || len(written) != 1 {
		t.Fatalf("keyring file: %d keys, %v", len(written), err)
	}
	made.GossipKey = identity.EncodeGossipKey(written[0])
	if want := identity.GossipKeyFingerprint(written[0]).String(); made.Fingerprint != want || strings.Contains(out, made.GossipKey) {
		t.Errorf("keygen --gossip --keyring --json = %s, want fingerprint %s and not the key", out, want)
	}
	sock := filepath.Join(dir, "admin.sock")
	cfgPath := filepath.Join(dir, "infermesh.yaml")
	cfg := fmt.Sprintf(`
node: {name: a, state_dir: %s}
admin: {socket: %s}
mesh: {bind: "127.0.0.1:0", quic: "127.0.0.1:%d"}
roles:
  chat: {port: %d}
`, state, sock, testnet.UDPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1"))
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	a, _ := startRealAgent(t, cfgPath)

	keyring := func() admin.Keyring {
		t.Helper()
		out, errOut, code := runCLI(t, "keyring", "list", "--json", "--socket", sock)
		if code != 0 {
			t.Fatalf("keyring: exit %d: %s", code, errOut)
		}
		var k admin.Keyring
		if err := json.Unmarshal([]byte(out), &k); err != nil {
			t.Fatal(err)
		}
		return k
	}
	fingerprint := func(text string) string {
		t.Helper()
		k, err := identity.ParseGossipKey(text)
		if err != nil {
			t.Fatal(err)
		}
		return identity.GossipKeyFingerprint(k).String()
	}

	second, err := identity.NewGossipKey()
	if err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := runCLI(t, "keyring", "install", second, "--socket", sock); code != 0 {
		t.Fatalf("keyring install: exit %d: %s", code, errOut)
	}
	cli := keyring()
	meshKeys, _ := a.Mesh().ListKeys()
	if len(cli.Keys) != 2 || len(meshKeys) != 2 {
		t.Fatalf("keys: CLI %d, mesh %d; want 2 and 2", len(cli.Keys), len(meshKeys))
	}
	for i, key := range []string{made.GossipKey, second} {
		want := fingerprint(key)
		if got := cli.Keys[i]; got.Key != key || got.Fingerprint != want {
			t.Errorf("CLI key %d = %s %s, want %s %s", i, got.Fingerprint, got.Key, want, key)
		}
		if got := meshKeys[i]; got.Key != key || got.Fingerprint.String() != want {
			t.Errorf("mesh key %d = %s %s, want %s %s", i, got.Fingerprint, got.Key, want, key)
		}
	}

	// The fingerprint the CLI shows names the key for use and remove.
	if _, errOut, code := runCLI(t, "keyring", "use", cli.Keys[1].Fingerprint, "--socket", sock); code != 0 {
		t.Fatalf("keyring use <fingerprint>: exit %d: %s", code, errOut)
	}
	if _, errOut, code := runCLI(t, "keyring", "remove", cli.Keys[0].Fingerprint, "--socket", sock); code != 0 {
		t.Fatalf("keyring remove <fingerprint>: exit %d: %s", code, errOut)
	}
	if got := keyring(); len(got.Keys) != 1 || got.Keys[0].Key != second || !got.Keys[0].Primary {
		t.Errorf("after use and remove by fingerprint = %+v, want only %s, primary", got.Keys, second)
	}
}
