package identity

import (
	"crypto/ed25519"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestLoadOrCreateKey(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", NodeKeyFile)
	k1, created, err := LoadOrCreateKey(path)
	if err != nil || !created {
		t.Fatalf("first LoadOrCreateKey = created %v, %v; want true, nil", created, err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.Mode().Perm(); got != 0o600 {
		t.Errorf("key file mode = %04o, want 0600", got)
	}
	k2, created, err := LoadOrCreateKey(path)
	if err != nil || created || !k1.Equal(k2) {
		t.Fatalf("second LoadOrCreateKey = created %v, %v, same key %v; want false, nil, true", created, err, k1.Equal(k2))
	}

	tests := []struct {
		name    string
		content string
		mode    os.FileMode
	}{
		{"group readable", encodePrivate(k1), 0o640},
		{"world readable", encodePrivate(k1), 0o604},
		{"not base64", "!!!", 0o600},
		{"wrong length", "AAAA", 0o600},
		{"empty", "", 0o600},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tt.name, " ", "_"))
			if err := os.WriteFile(p, []byte(tt.content), tt.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, tt.mode); err != nil {
				t.Fatal(err)
			}
			_, _, err := LoadOrCreateKey(p)
			if !errors.Is(err, ErrKeyFile) {
				t.Fatalf("LoadOrCreateKey = %v, want ErrKeyFile", err)
			}
			got, _ := os.ReadFile(p)
			if string(got) != tt.content {
				t.Errorf("bad key file was rewritten: %q, want %q", got, tt.content)
			}
		})
	}
	if _, err := WriteNewKey(path); !errors.Is(err, fs.ErrExist) {
		t.Errorf("WriteNewKey over an existing key = %v, want fs.ErrExist", err)
	}
}

func TestValidateNodeName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"a", true}, {"node-1.example_x", true}, {"", false}, {".", false}, {"..", false},
		{"a/b", false}, {"a b", false}, {"a=", false}, {strings.Repeat("x", MaxNodeNameLen), true},
		{strings.Repeat("x", MaxNodeNameLen+1), false}, {strings.Repeat("x", 64), false},
		{"-a", false}, {".a", false}, {"_a", false}, {"9a", true}, {"A.", true}, {"a..b", true},
	}
	for _, tt := range tests {
		if err := ValidateNodeName(tt.name); (err == nil) != tt.ok {
			t.Errorf("ValidateNodeName(%q) = %v, want ok=%v", tt.name, err, tt.ok)
		}
	}
}

func TestCertificateRoundTripAndVerify(t *testing.T) {
	apub, apriv, _ := ed25519.GenerateKey(nil)
	opub, _, _ := ed25519.GenerateKey(nil)
	npub, _, _ := ed25519.GenerateKey(nil)
	now := time.Unix(1_700_000_000, 0)
	c, err := IssueCertificate(apriv, "node-1", npub, ScopeConsumer, 720*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseCertificate(c.String())
	if err != nil {
		t.Fatal(err)
	}
	if got.Name != "node-1" || !got.PublicKey.Equal(npub) || got.Scope != ScopeConsumer || !got.Expires.Equal(now.Add(720*time.Hour)) {
		t.Errorf("parsed certificate = %+v, want node-1/consumer/+720h", got)
	}
	if err := VerifyCertificate(got, []ed25519.PublicKey{opub, apub}); err != nil {
		t.Errorf("VerifyCertificate with the authority = %v, want nil", err)
	}
	if err := VerifyCertificate(got, []ed25519.PublicKey{opub}); !errors.Is(err, ErrBadCertificate) {
		t.Errorf("VerifyCertificate with another authority = %v, want ErrBadCertificate", err)
	}
	got.Name = "node-2"
	if err := VerifyCertificate(got, []ed25519.PublicKey{apub}); err == nil {
		t.Error("VerifyCertificate accepted a renamed certificate")
	}
	for _, bad := range []string{"", "AAAA", "not base64!", c.String()[:20]} {
		if _, err := ParseCertificate(bad); !errors.Is(err, ErrBadCertificate) {
			t.Errorf("ParseCertificate(%q) = %v, want ErrBadCertificate", bad, err)
		}
	}
	if _, err := IssueCertificate(apriv, "bad name", npub, ScopeFull, time.Hour, now); err == nil {
		t.Error("IssueCertificate accepted a bad node name")
	}
}

// TestKeyRootWritesIsTheDirOwners: root writing a key or keyring into a
// directory another user owns (the agent's state directory, the unit
// running as its own user) gives the file to that user, so the agent can
// read it; in root's own directory the file stays root's.
func TestKeyRootWritesIsTheDirOwners(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root can give a file to another user")
	}
	const uid, gid = 65534, 65534
	agentDir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(agentDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(agentDir, uid, gid); err != nil {
		t.Fatal(err)
	}
	rootDir := t.TempDir()
	owner := func(p string) (uint32, uint32, os.FileMode) {
		t.Helper()
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		sys := st.Sys().(*syscall.Stat_t)
		return sys.Uid, sys.Gid, st.Mode().Perm()
	}
	for _, tt := range []struct {
		dir      string
		uid, gid uint32
	}{{agentDir, uid, gid}, {rootDir, 0, 0}} {
		key := filepath.Join(tt.dir, NodeKeyFile)
		if _, _, err := LoadOrCreateKey(key); err != nil {
			t.Fatal(err)
		}
		ring := filepath.Join(tt.dir, "keyring.json")
		if _, err := WriteNewKeyring(ring); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{key, ring} {
			if u, g, m := owner(p); u != tt.uid || g != tt.gid || m != 0o600 {
				t.Errorf("%s: %d:%d %04o, want %d:%d 0600", p, u, g, m, tt.uid, tt.gid)
			}
		}
	}
}
