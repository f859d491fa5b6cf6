package mesh

import (
	"crypto/ed25519"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
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
		{strings.Repeat("x", MaxNodeNameLen+1), false},
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

func TestTrustAdmit(t *testing.T) {
	apub, apriv, _ := ed25519.GenerateKey(nil)
	kA, _, _ := ed25519.GenerateKey(nil)
	kB, _, _ := ed25519.GenerateKey(nil)
	kC, _, _ := ed25519.GenerateKey(nil)
	now := time.Now()
	certB, _ := IssueCertificate(apriv, "b", kB, ScopeFull, time.Hour, now)
	certC, _ := IssueCertificate(apriv, "c", kC, ScopeConsumer, time.Hour, now)
	ts, err := newTrustState(TrustConfig{
		Authorities: []ed25519.PublicKey{apub},
		Nodes:       []TrustedNode{{Name: "a", PublicKey: kA}, {Name: "s", PublicKey: kC, Scope: ScopeConsumer}},
		Revoked:     []string{"r", EncodeKey(kC)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		node      string
		key       ed25519.PublicKey
		cert      *Certificate
		at        time.Time
		wantScope Scope
		wantWhy   string
	}{
		{"static", "a", kA, nil, now, ScopeFull, ""},
		{"static pins the key", "a", kB, certB, now, 0, whyKeyMismatch},
		{"certificate", "b", kB, certB, now, ScopeFull, ""},
		{"certificate expired", "b", kB, certB, now.Add(2 * time.Hour), 0, whyCertExpired},
		{"certificate of another node", "x", kB, certB, now, 0, whyCertOther},
		{"no proof", "x", kB, nil, now, 0, whyNotTrusted},
		{"revoked name", "r", kB, certB, now, 0, whyRevoked},
		{"revoked key", "c", kC, certC, now, 0, whyRevoked},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, why := ts.admit(tt.node, tt.key, tt.cert, ts.certOK(tt.cert), tt.at)
			if s != tt.wantScope || why != tt.wantWhy {
				t.Errorf("admit = %v, %q; want %v, %q", s, why, tt.wantScope, tt.wantWhy)
			}
		})
	}
	bad := []TrustConfig{
		{Nodes: []TrustedNode{{Name: "a", PublicKey: kA}, {Name: "a", PublicKey: kB}}},
		{Nodes: []TrustedNode{{Name: "bad name", PublicKey: kA}}},
		{Nodes: []TrustedNode{{Name: "a", PublicKey: kA[:5]}}},
		{Revoked: []string{"not a name!"}},
		{Authorities: []ed25519.PublicKey{apub[:3]}},
	}
	for i, c := range bad {
		if _, err := newTrustState(c, nil); err == nil {
			t.Errorf("bad trust config %d accepted", i)
		}
	}
}

func TestNodeMetaFitsAndRoundTrips(t *testing.T) {
	pub, priv, _ := ed25519.GenerateKey(nil)
	_, apriv, _ := ed25519.GenerateKey(nil)
	name := strings.Repeat("n", MaxNodeNameLen)
	cert, _ := IssueCertificate(apriv, name, pub, ScopeFull, time.Hour, time.Now())
	nm := &nodeMeta{
		cluster:  strings.Repeat("c", maxClusterLen),
		key:      pub,
		quicAddr: strings.Repeat("q", maxQUICAddrLen),
		cert:     cert,
		keyFPs:   make([][8]byte, maxGossipKeys),
	}
	b, err := nm.marshal(name, priv)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > memberlist.MetaMaxSize {
		t.Fatalf("largest meta is %d bytes, more than memberlist's %d", len(b), memberlist.MetaMaxSize)
	}
	got, err := parseMeta(name, b)
	if err != nil {
		t.Fatal(err)
	}
	if got.cluster != nm.cluster || !got.key.Equal(pub) || got.quicAddr != nm.quicAddr || got.cert.Name != name || len(got.keyFPs) != maxGossipKeys {
		t.Errorf("meta round trip = %+v", got)
	}
	if _, err := parseMeta("other", b); err == nil {
		t.Error("meta signed for one name parsed under another")
	}
	for i := range b {
		c := append([]byte(nil), b...)
		c[i] ^= 0x40
		if _, err := parseMeta(name, c); err == nil {
			t.Fatalf("meta with byte %d flipped parsed", i)
		}
	}
}

func TestConfigValidationNamesTheField(t *testing.T) {
	base := func() Config { return Config{NodeName: "a", StateDir: t.TempDir()} }
	tests := []struct {
		field string
		mod   func(*Config)
	}{
		{"NodeName", func(c *Config) { c.NodeName = "a b" }},
		{"StateDir", func(c *Config) { c.StateDir = "" }},
		{"BindAddr", func(c *Config) { c.BindAddr = "nohost" }},
		{"QUICAddr", func(c *Config) { c.QUICAddr = "x" }},
		{"Cluster", func(c *Config) { c.Cluster = strings.Repeat("c", 65) }},
		{"AdvertTTL", func(c *Config) { c.AdvertTTL = -1 }},
		{"GossipInterval", func(c *Config) { c.AdvertTTL = time.Second; c.GossipInterval = time.Second }},
		{"Trust.Nodes[0]", func(c *Config) { c.Trust.Nodes = []TrustedNode{{Name: "x"}} }},
		{"Certificate", func(c *Config) { c.Certificate = "garbage" }},
	}
	for _, tt := range tests {
		t.Run(tt.field, func(t *testing.T) {
			c := base()
			tt.mod(&c)
			_, err := New(c)
			if err == nil || !strings.Contains(err.Error(), tt.field) {
				t.Errorf("New = %v, want an error naming %s", err, tt.field)
			}
		})
	}
	// A missing keyring is an error, with a hint.
	if _, err := New(base()); err == nil || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("New without keyring = %v, want fs.ErrNotExist", err)
	}
}
