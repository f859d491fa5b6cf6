package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
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
	// install answers with the keyring by fingerprint: the key it was
	// given is not printed back.
	out, errOut, code = runCLI(t, "keyring", "install", second, "--socket", sock)
	if code != 0 || strings.Contains(out+errOut, second) || !strings.Contains(out, fingerprint(second)) {
		t.Fatalf("keyring install: exit %d, %q, %q; want the fingerprint %s and not the key", code, out, errOut, fingerprint(second))
	}
	cli := keyring()
	meshKeys, _ := a.Mesh().ListKeys()
	if len(cli.Keys) != 2 || len(meshKeys) != 2 {
		t.Fatalf("keys: CLI %d, mesh %d; want 2 and 2", len(cli.Keys), len(meshKeys))
	}
	for i, key := range []string{made.GossipKey, second} {
		want := fingerprint(key)
		if got := cli.Keys[i]; got.Key != "" || got.Fingerprint != want {
			t.Errorf("CLI key %d = %s %q, want %s and no key", i, got.Fingerprint, got.Key, want)
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
	if got, _ := a.Mesh().ListKeys(); len(got) != 1 || got[0].Key != second || !got[0].Primary {
		t.Errorf("after use and remove by fingerprint = %+v, want only %s, primary", got, second)
	}
}

// TestKeyringSecretsNeverToATerminal: against a real agent, keyring list
// shows fingerprints only (text and JSON, and the agent sends no key over
// the socket); the keys themselves go to a new 0600 file with --out, or
// to stdout with --print-keys when it is not a terminal, and never to a
// terminal.
func TestKeyringSecretsNeverToATerminal(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	kr := filepath.Join(state, "keyring.json")
	if _, err := identity.WriteNewKeyring(kr); err != nil {
		t.Fatal(err)
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
	keys, _ := a.Mesh().ListKeys()
	if len(keys) != 1 {
		t.Fatalf("the agent holds %d keys, want 1", len(keys))
	}
	key, fp := keys[0].Key, keys[0].Fingerprint.String()

	for _, args := range [][]string{{"keyring", "list"}, {"keyring", "list", "--json"}} {
		out, errOut, code := runCLI(t, append(args, "--socket", sock)...)
		if code != 0 || strings.Contains(out+errOut, key) || !strings.Contains(out, fp) {
			t.Errorf("%v = exit %d, %q, %q; want fingerprint %s and not the key", args, code, out, errOut, fp)
		}
	}
	c := admin.NewClient(sock, admin.ClientOptions{})
	defer c.Close()
	if k, err := c.Keyring(context.Background()); err != nil || len(k.Keys) != 1 || k.Keys[0].Key != "" || k.Keys[0].Fingerprint != fp {
		t.Errorf("GET /v0/keyring = %+v, %v; want the fingerprint and no key sent", k, err)
	}

	// --print-keys to a pipe: the key, alone.
	out, errOut, code := runCLI(t, "keyring", "list", "--print-keys", "--socket", sock)
	if code != 0 || out != key+"\n" {
		t.Errorf("keyring list --print-keys = exit %d, %q, %q; want the key alone", code, out, errOut)
	}
	// --out: a new keyring file, 0600, that the agent's loader reads.
	file := filepath.Join(dir, "copy.json")
	out, errOut, code = runCLI(t, "keyring", "list", "--out", file, "--socket", sock)
	got, lerr := identity.LoadKeyring(file)
	if code != 0 || lerr != nil || len(got) != 1 || identity.EncodeGossipKey(got[0]) != key || strings.Contains(out+errOut, key) || !strings.Contains(out, fp) {
		t.Errorf("keyring list --out = exit %d, %q, %q, file %v %v; want the key in the file only", code, out, errOut, got, lerr)
	}
	if st, err := os.Stat(file); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("keyring file %s: %v, %v; want mode 0600", file, err, st)
	}
	if _, errOut, code := runCLI(t, "keyring", "list", "--out", file, "--socket", sock); code == 0 || !strings.Contains(errOut, "never replaced") {
		t.Errorf("keyring list --out over an existing file = exit %d, %q; want a refusal", code, errOut)
	}

	// A terminal: refused, and nothing of the key reaches it.
	master, slave := openPTY(t)
	var stderr strings.Builder
	code = run([]string{"keyring", "list", "--print-keys", "--socket", sock}, slave, &stderr)
	slave.Close()
	shown := drain(master)
	if code != exitUsage || !strings.Contains(stderr.String(), "refusing to print secret gossip keys to a terminal") || strings.Contains(shown, key) {
		t.Errorf("keyring list --print-keys on a terminal = exit %d, %q, terminal %q; want a refusal", code, stderr.String(), shown)
	}
	// Without the flag the terminal gets the fingerprint table.
	master, slave = openPTY(t)
	code = run([]string{"keyring", "list", "--socket", sock}, slave, &stderr)
	slave.Close()
	if shown := drain(master); code != 0 || !strings.Contains(shown, fp) || strings.Contains(shown, key) {
		t.Errorf("keyring list on a terminal = exit %d, %q; want the fingerprint and not the key", code, shown)
	}
}

// openPTY opens a pseudo-terminal: what the CLI writes to slave shows on
// master.
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("a pseudo-terminal: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatalf("unlock pty: %v", err)
	}
	n, err := unix.IoctlGetUint32(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatalf("pty number: %v", err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("pty slave: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return m, s
}

// drain reads what the terminal shows once its slave is closed (the
// master then reads EIO).
func drain(master *os.File) string {
	b, _ := io.ReadAll(master)
	return string(b)
}
