package mesh

import (
	"crypto/ed25519"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

func TestTrustAdmit(t *testing.T) {
	apub, apriv, _ := ed25519.GenerateKey(nil)
	kA, _, _ := ed25519.GenerateKey(nil)
	kB, _, _ := ed25519.GenerateKey(nil)
	kC, _, _ := ed25519.GenerateKey(nil)
	now := time.Now()
	certB, _ := identity.IssueCertificate(apriv, "b", kB, identity.ScopeFull, time.Hour, now)
	certC, _ := identity.IssueCertificate(apriv, "c", kC, identity.ScopeConsumer, time.Hour, now)
	ts, err := newTrustState(TrustConfig{
		Authorities: []ed25519.PublicKey{apub},
		Nodes:       []TrustedNode{{Name: "a", PublicKey: kA}, {Name: "s", PublicKey: kC, Scope: identity.ScopeConsumer}},
		Revoked:     []string{"r", identity.EncodeNodeKey(kC)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		node      string
		key       ed25519.PublicKey
		cert      *identity.Certificate
		at        time.Time
		wantScope identity.Scope
		wantWhy   string
	}{
		{"static", "a", kA, nil, now, identity.ScopeFull, ""},
		{"static pins the key", "a", kB, certB, now, 0, whyKeyMismatch},
		{"certificate", "b", kB, certB, now, identity.ScopeFull, ""},
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

// TestCertOKRemembersPerTrust: certOK's remembered verdicts belong to one
// set of authorities, and are keyed by the whole certificate: a body
// altered under a valid signature is refused after the valid one was
// accepted, and a new trust state decides afresh.
func TestCertOKRemembersPerTrust(t *testing.T) {
	apub, apriv, _ := ed25519.GenerateKey(nil)
	otherPub, _, _ := ed25519.GenerateKey(nil)
	kB, _, _ := ed25519.GenerateKey(nil)
	cert, err := identity.IssueCertificate(apriv, "b", kB, identity.ScopeConsumer, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	trusting, err := newTrustState(TrustConfig{Authorities: []ed25519.PublicKey{apub}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second answer comes from the cache
		if !trusting.certOK(cert) {
			t.Fatalf("certOK(valid cert) = false, want true")
		}
	}
	forged := *cert
	forged.Scope = identity.ScopeFull
	if trusting.certOK(&forged) {
		t.Errorf("certOK(scope altered under the same signature) = true, want false")
	}
	other, err := newTrustState(TrustConfig{Authorities: []ed25519.PublicKey{otherPub}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if other.certOK(cert) {
		t.Errorf("certOK under other authorities = true, want false")
	}
	if trusting.certOK(nil) {
		t.Errorf("certOK(nil) = true, want false")
	}
}

// BenchmarkCertOKHit measures the verdict lookup the alive delegate and
// every peer update make for a certificate already verified.
func BenchmarkCertOKHit(b *testing.B) {
	apub, apriv, _ := ed25519.GenerateKey(nil)
	kB, _, _ := ed25519.GenerateKey(nil)
	cert, err := identity.IssueCertificate(apriv, "b", kB, identity.ScopeFull, time.Hour, time.Now())
	if err != nil {
		b.Fatal(err)
	}
	ts, err := newTrustState(TrustConfig{Authorities: []ed25519.PublicKey{apub}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	ts.certOK(cert)
	b.ReportAllocs()
	for b.Loop() {
		if !ts.certOK(cert) {
			b.Fatal("certOK = false")
		}
	}
}
