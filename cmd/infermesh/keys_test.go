package main

import (
	"bytes"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/identity"
)

func runCLI(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut)
	return out.String(), errOut.String(), code
}

func TestKeygen(t *testing.T) {
	dir := t.TempDir()
	out, errOut, code := runCLI(t, "keygen", "--state-dir", dir, "--json")
	if code != 0 {
		t.Fatalf("keygen exit %d: %s", code, errOut)
	}
	var first keyResult
	if err := json.Unmarshal([]byte(out), &first); err != nil {
		t.Fatal(err)
	}
	if !first.Created || first.Path != filepath.Join(dir, identity.NodeKeyFile) {
		t.Errorf("first keygen = %+v, want created at %s/node.key", first, dir)
	}
	st, err := os.Stat(first.Path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v, mode %v; want 0600", err, st.Mode().Perm())
	}
	// Text: stdout is the key alone (KA=$(infermesh keygen) needs no
	// pipe), the notice goes to stderr.
	dir2 := t.TempDir()
	out, errOut, code = runCLI(t, "keygen", "--state-dir", dir2)
	if _, err := identity.ParsePublicKey(strings.TrimSuffix(out, "\n")); code != 0 || err != nil || strings.Count(out, "\n") != 1 {
		t.Errorf("keygen stdout = %q (exit %d, %v), want one line: the public key", out, code, err)
	}
	if !strings.Contains(errOut, "new key written to") {
		t.Errorf("keygen stderr = %q, want the notice", errOut)
	}
	// Again: the same key, not replaced.
	out, _, code = runCLI(t, "keygen", "--state-dir", dir)
	if code != 0 || strings.TrimSpace(out) != first.PublicKey {
		t.Errorf("second keygen = %q (exit %d), want the existing public key %s", out, code, first.PublicKey)
	}
	// A wrong-mode key is an error, not a new key.
	if err := os.Chmod(first.Path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := runCLI(t, "keygen", "--state-dir", dir); code == 0 || !strings.Contains(errOut, "mode") {
		t.Errorf("keygen on a 0644 key: exit %d, %q; want an error about the mode", code, errOut)
	}
}

func TestGossipKeygen(t *testing.T) {
	out, _, code := runCLI(t, "keygen", "--gossip")
	if _, err := identity.ParseGossipKey(out); code != 0 || err != nil {
		t.Fatalf("keygen --gossip = %q (exit %d): %v", out, code, err)
	}
	kr := filepath.Join(t.TempDir(), "keyring.json")
	out, errOut, code := runCLI(t, "keygen", "--gossip", "--keyring", kr)
	if code != 0 {
		t.Fatalf("keygen --gossip --keyring exit %d: %s", code, errOut)
	}
	keys, err := identity.LoadKeyring(kr)
	if err != nil || len(keys) != 1 {
		t.Fatalf("LoadKeyring = %d keys, %v; want 1", len(keys), err)
	}
	// The secret stays in the file: stdout names it by fingerprint only.
	if want := identity.GossipKeyFingerprint(keys[0]).String() + "\n"; out != want {
		t.Errorf("keygen --gossip --keyring printed %q, want only the fingerprint %q", out, want)
	}
	if k := identity.EncodeGossipKey(keys[0]); strings.Contains(out+errOut, k) {
		t.Errorf("keygen --gossip --keyring printed the secret key %s", k)
	}
	if _, _, code := runCLI(t, "keygen", "--gossip", "--keyring", kr); code == 0 {
		t.Error("keygen --gossip over an existing keyring succeeded")
	}
}

func TestAuthorityInitAndIssue(t *testing.T) {
	dir := t.TempDir()
	ak := filepath.Join(dir, "authority.key")
	out, errOut, code := runCLI(t, "authority", "init", "--key-file", ak, "--json")
	if code != 0 {
		t.Fatalf("authority init exit %d: %s", code, errOut)
	}
	var init keyResult
	if err := json.Unmarshal([]byte(out), &init); err != nil {
		t.Fatal(err)
	}
	apub, err := identity.ParsePublicKey(init.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, code := runCLI(t, "authority", "init", "--key-file", ak); code == 0 {
		t.Error("authority init over an existing key succeeded")
	}
	// Text: `> file` captures the public key alone; the notice is on stderr.
	out, errOut, code = runCLI(t, "authority", "init", "--key-file", filepath.Join(dir, "a2.key"))
	if _, err := identity.ParsePublicKey(strings.TrimSuffix(out, "\n")); code != 0 || err != nil || strings.Count(out, "\n") != 1 {
		t.Errorf("authority init stdout = %q (exit %d, %v), want one line: the public key", out, code, err)
	}
	if !strings.Contains(errOut, "keep it offline") {
		t.Errorf("authority init stderr = %q, want the notice", errOut)
	}

	// show prints the public key again (and its fingerprint), never the
	// private key; a second init refuses, so this is how to get it back.
	out, errOut, code = runCLI(t, "authority", "show", "--key-file", ak)
	akey, err := identity.LoadKey(ak)
	if err != nil {
		t.Fatal(err)
	}
	fp := identity.PublicKeyFingerprint(apub).String()
	if code != 0 || out != init.PublicKey+"\n" || !strings.Contains(errOut, "fingerprint "+fp) {
		t.Errorf("authority show = %q, %q (exit %d); want the public key %s on stdout, fingerprint %s on stderr", out, errOut, code, init.PublicKey, fp)
	}
	out, _, code = runCLI(t, "authority", "show", "--key-file", ak, "--json")
	var showed keyResult
	if err := json.Unmarshal([]byte(out), &showed); code != 0 || err != nil || showed.PublicKey != init.PublicKey || showed.Fingerprint != fp || showed.Path != ak {
		t.Errorf("authority show --json = %q (exit %d, %v); want the public key, fingerprint %s and the path", out, code, err, fp)
	}
	for _, secret := range []string{base64.StdEncoding.EncodeToString(akey.Seed()), base64.StdEncoding.EncodeToString(akey), hex.EncodeToString(akey.Seed())} {
		if strings.Contains(out+errOut, secret) {
			t.Errorf("authority show printed the private key")
		}
	}
	if _, errOut, code := runCLI(t, "authority", "show", "--key-file", filepath.Join(dir, "none.key")); code == 0 || !strings.Contains(errOut, "none.key") {
		t.Errorf("authority show of a missing key file = exit %d, %q; want a failure naming it", code, errOut)
	}

	nodeOut, _, _ := runCLI(t, "keygen", "--state-dir", filepath.Join(dir, "n"))
	nodePub := strings.Fields(nodeOut)[0]
	out, errOut, code = runCLI(t, "authority", "issue", "--key-file", ak, "--name", "node-1",
		"--public-key", nodePub, "--scope", "consumer", "--ttl", "720h")
	if code != 0 {
		t.Fatalf("authority issue exit %d: %s", code, errOut)
	}
	cert, err := identity.ParseCertificate(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := identity.VerifyCertificate(cert, []ed25519.PublicKey{apub}); err != nil {
		t.Errorf("issued certificate does not verify: %v", err)
	}
	if cert.Name != "node-1" || identity.EncodeNodeKey(cert.PublicKey) != nodePub || cert.Scope != identity.ScopeConsumer {
		t.Errorf("certificate = %s/%s/%v, want node-1/%s/consumer", cert.Name, identity.EncodeNodeKey(cert.PublicKey), cert.Scope, nodePub)
	}

	// infermesh cert shows it, from the text or a file, and checks it.
	certFile := filepath.Join(dir, "node-1.cert")
	if err := os.WriteFile(certFile, []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, arg := range []string{strings.TrimSpace(out), certFile} {
		shown, errOut, code := runCLI(t, "cert", arg, "--authority", init.PublicKey)
		for _, want := range []string{"subject:    node-1", "scope:      consumer", "public key: " + nodePub, "expires in", "valid for the authority"} {
			if code != 0 || !strings.Contains(shown, want) {
				t.Errorf("cert %.20s... = %q (exit %d, %s), want %q", arg, shown, code, errOut, want)
			}
		}
	}
	// Another authority: what the certificate says is shown, and the
	// exit code says it is not that authority's.
	other := identity.EncodeAuthorityKey(nodePubKey(t, nodePub))
	shown, errOut, code := runCLI(t, "cert", certFile, "--authority", other)
	if want := "infermesh: the certificate of node-1 is not signed by authority " + other + "\n"; code != exitFailure || !strings.Contains(shown, "NOT by this authority") || errOut != want {
		t.Errorf("cert with another authority = %q, %q (exit %d); want the signature refused, exit %d and %q", shown, errOut, code, exitFailure, want)
	}
	shown, _, code = runCLI(t, "cert", certFile, "--authority", other, "--json")
	if code != exitFailure || !strings.Contains(shown, `"signature_ok": false`) {
		t.Errorf("cert --json with another authority = %q (exit %d), want signature_ok false and exit %d", shown, code, exitFailure)
	}

	bad := [][]string{
		{"--name", "node-1", "--public-key", "xx"},
		{"--name", "bad name", "--public-key", nodePub},
		{"--name", "node-1", "--public-key", nodePub, "--scope", "admin"},
		{"--name", "node-1", "--public-key", nodePub, "--ttl", "-1h"},
		{"--public-key", nodePub},
	}
	for _, args := range bad {
		if _, _, code := runCLI(t, append([]string{"authority", "issue", "--key-file", ak}, args...)...); code == 0 {
			t.Errorf("authority issue %v succeeded, want an error", args)
		}
	}
}

func TestSocketDefault(t *testing.T) {
	t.Setenv("INFERMESH_SOCKET", "/tmp/x.sock")
	a := &app{out: &bytes.Buffer{}, errOut: &bytes.Buffer{}}
	root := newRoot(a)
	if err := root.ParseFlags(nil); err != nil {
		t.Fatal(err)
	}
	if a.socket != "/tmp/x.sock" {
		t.Errorf("socket = %q, want INFERMESH_SOCKET's /tmp/x.sock", a.socket)
	}
}

func nodePubKey(t *testing.T, s string) ed25519.PublicKey {
	t.Helper()
	k, err := identity.ParsePublicKey(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
