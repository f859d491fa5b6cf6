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
	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// cli runs the CLI and fails the test unless it exits 0.
func cli(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := runCLI(t, args...)
	if code != 0 {
		t.Fatalf("infermesh %s: exit %d: %s%s", strings.Join(args, " "), code, out, errOut)
	}
	return out
}

// signedOverride returns the signed revocation the agent lists for
// subject, with its statement parsed.
func signedOverride(t *testing.T, sock, subject string) (admin.Override, *identity.Revocation) {
	t.Helper()
	var ovs []admin.Override
	if err := json.Unmarshal([]byte(cli(t, "policy", "list", "--json", "--socket", sock)), &ovs); err != nil {
		t.Fatal(err)
	}
	for _, o := range ovs {
		if o.Kind == admin.KindSignedRevoke && o.Node == subject {
			r, err := identity.ParseRevocation(o.Statement)
			if err != nil {
				t.Fatal(err)
			}
			return o, r
		}
	}
	t.Fatalf("no signed revocation of %s in %+v", subject, ovs)
	return admin.Override{}, nil
}

// TestRevokeWithTheAuthorityKey: `revoke --authority-key` signs the
// statement here (the key is read by the CLI, never sent) and the agent
// holds and keeps it; `policy list` shows it. Without the key a
// revocation says it is this node's alone, and unrevoke without the key
// cannot lift a signed one. Unrevoke with the key signs a newer statement;
// `policy reset` keeps it. A key that is not the authority's is refused.
func TestRevokeWithTheAuthorityKey(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	authKey := filepath.Join(dir, "authority.key")
	authPub := strings.TrimSpace(cli(t, "authority", "init", "--key-file", authKey))
	nodePub := strings.TrimSpace(cli(t, "keygen", "--state-dir", state))
	cert := strings.TrimSpace(cli(t, "authority", "issue", "--key-file", authKey, "--name", "a", "--public-key", nodePub))
	cli(t, "keygen", "--gossip", "--keyring", filepath.Join(state, "keyring.json"))
	sock := filepath.Join(dir, "admin.sock")
	cfgPath := filepath.Join(dir, "infermesh.yaml")
	cfg := fmt.Sprintf(`
node: {name: a, state_dir: %s}
admin: {socket: %s}
mesh: {bind: 127.0.0.1:%d, quic: 127.0.0.1:%d}
trust: {authority: %q, certificate: %q}
roles:
  chat: {port: %d}
`, state, sock, testnet.TCPUDPPort(t, "127.0.0.1"), testnet.UDPPort(t, "127.0.0.1"), authPub, cert, testnet.TCPPort(t, "127.0.0.1"))
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	a, _ := startRealAgent(t, cfgPath)

	out := cli(t, "revoke", "c", "--authority-key", authKey, "--socket", sock)
	t.Log(out)
	if !strings.Contains(out, "revoke c, signed by the authority (serial") || !strings.Contains(out, "held here") {
		t.Errorf("revoke --authority-key printed:\n%s", out)
	}
	_, first := signedOverride(t, sock, "c")
	if r, ok := a.Mesh().Revocation("c"); !ok || !r.Revoked || r.Serial != first.Serial {
		t.Errorf("the agent holds %v, %v; want the statement the CLI signed", r, ok)
	}
	if list := cli(t, "policy", "list", "--socket", sock); !strings.Contains(list, "revoke c, signed by the authority") {
		t.Errorf("policy list:\n%s", list)
	}

	if out := cli(t, "revoke", "d", "--socket", sock); !strings.Contains(out, "revoked on this node only") ||
		!strings.Contains(out, "infermesh revoke d --authority-key FILE") {
		t.Errorf("revoke without the authority key printed:\n%s", out)
	}
	if _, errOut, code := runCLI(t, "unrevoke", "c", "--socket", sock); code == 0 || !strings.Contains(errOut, "--authority-key") {
		t.Errorf("unrevoke of a signed revocation without the key: exit %d, %q; want a refusal naming --authority-key", code, errOut)
	}

	cli(t, "unrevoke", "c", "--authority-key", authKey, "--socket", sock)
	o, lift := signedOverride(t, sock, "c")
	if o.On || lift.Revoked || lift.Serial <= first.Serial {
		t.Errorf("after unrevoke --authority-key: %+v serial %d; want a lifting with a serial above %d", o, lift.Serial, first.Serial)
	}
	if r, ok := a.Mesh().Revocation("c"); !ok || r.Revoked {
		t.Errorf("the agent holds %v about c, want the lifting", r)
	}
	cli(t, "policy", "reset", "--socket", sock)
	if _, kept := signedOverride(t, sock, "c"); kept.Serial != lift.Serial {
		t.Errorf("policy reset dropped or changed the signed lifting: serial %d, want %d", kept.Serial, lift.Serial)
	}

	otherKey := filepath.Join(dir, "other.key")
	cli(t, "authority", "init", "--key-file", otherKey)
	if _, errOut, code := runCLI(t, "revoke", "c", "--authority-key", otherKey, "--socket", sock); code == 0 ||
		!strings.Contains(errOut, "not signed by a trusted authority") {
		t.Errorf("revoke signed by another key: exit %d, %q; want refused", code, errOut)
	}
	if r, _ := a.Mesh().Revocation("c"); r.Revoked {
		t.Error("a statement signed by another key revoked c")
	}
}
