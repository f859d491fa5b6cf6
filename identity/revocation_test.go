package identity

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"testing"
	"time"
)

func newAuthority(t *testing.T) (ed25519.PublicKey, ed25519.PrivateKey) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return pub, priv
}

func TestRevocationRoundTrip(t *testing.T) {
	pub, priv := newAuthority(t)
	nodePub, _ := newAuthority(t)
	now := time.Unix(1_800_000_000, 0)
	for _, tt := range []struct {
		subject string
		revoked bool
	}{
		{"c", true},
		{"c", false},
		{EncodeKey(nodePub), true},
	} {
		r, err := IssueRevocation(priv, tt.subject, tt.revoked, 42, now)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseRevocation(r.String())
		if err != nil {
			t.Fatalf("ParseRevocation(%s) = %v", tt.subject, err)
		}
		if got.Subject() != tt.subject || got.Revoked != tt.revoked || got.Serial != 42 || !got.IssuedAt.Equal(now) {
			t.Errorf("round trip of %s/%v = %+v", tt.subject, tt.revoked, got)
		}
		if signer, err := VerifyRevocation(got, []ed25519.PublicKey{nodePub, pub}); err != nil || !signer.Equal(pub) {
			t.Errorf("VerifyRevocation = %v, %v; want the authority", signer, err)
		}
		if len(r.Marshal()) > MaxRevocationLen {
			t.Errorf("%d bytes, more than MaxRevocationLen %d", len(r.Marshal()), MaxRevocationLen)
		}
	}
}

// TestRevocationSignatureCoversEveryField: changing any byte of a signed
// statement (the operation above all: a revocation turned into a
// lifting) breaks its signature.
func TestRevocationSignatureCoversEveryField(t *testing.T) {
	pub, priv := newAuthority(t)
	r, err := IssueRevocation(priv, "node-c", true, 7, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	b := r.Marshal()
	for i := range len(b) - ed25519.SignatureSize {
		bad := append([]byte(nil), b...)
		bad[i] ^= 0x01
		got, err := UnmarshalRevocation(bad)
		if err != nil {
			continue // no longer parses: refused too
		}
		if _, err := VerifyRevocation(got, []ed25519.PublicKey{pub}); !errors.Is(err, ErrBadRevocation) {
			t.Errorf("byte %d flipped: VerifyRevocation = %v, want ErrBadRevocation", i, err)
		}
	}
	other, _ := newAuthority(t)
	if _, err := VerifyRevocation(r, []ed25519.PublicKey{other}); !errors.Is(err, ErrBadRevocation) {
		t.Errorf("another authority: %v, want ErrBadRevocation", err)
	}
	if _, err := VerifyRevocation(r, nil); !errors.Is(err, ErrBadRevocation) {
		t.Errorf("no authority: %v, want ErrBadRevocation", err)
	}
}

func TestRevocationRefusesMalformed(t *testing.T) {
	_, priv := newAuthority(t)
	r, _ := IssueRevocation(priv, "c", true, 1, time.Now())
	good := r.Marshal()
	for name, b := range map[string][]byte{
		"empty":        nil,
		"truncated":    good[:len(good)-1],
		"longer":       append(append([]byte(nil), good...), 0),
		"version":      append([]byte{9}, good[1:]...),
		"operation":    append([]byte{good[0], 7}, good[2:]...),
		"subject kind": append([]byte{good[0], good[1], 9}, good[3:]...),
	} {
		if _, err := UnmarshalRevocation(b); !errors.Is(err, ErrBadRevocation) {
			t.Errorf("%s: %v, want ErrBadRevocation", name, err)
		}
	}
	if _, err := IssueRevocation(priv, "not a name", true, 1, time.Now()); err == nil {
		t.Error("a subject that is neither a name nor a key was signed")
	}
	if _, err := IssueRevocation(priv, "c", true, 0, time.Now()); err == nil {
		t.Error("serial 0 was signed")
	}
}

// TestRevocationOrder: the newest statement about a subject holds. A
// higher serial wins whatever it says (so an unrevoke beats the
// revocation it lifts, and a replay of that older revocation changes
// nothing); a tie fails closed; the order is total, so every node keeps
// the same statement.
func TestRevocationOrder(t *testing.T) {
	_, priv := newAuthority(t)
	now := time.Now()
	st := func(revoked bool, serial uint64, at time.Time) *Revocation {
		r, err := IssueRevocation(priv, "c", revoked, serial, at)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	revoke1, lift2, revoke3 := st(true, 1, now), st(false, 2, now), st(true, 3, now)
	tie := st(false, 3, now)
	tieLater := st(true, 3, now.Add(time.Hour))
	for _, tt := range []struct {
		name string
		r, o *Revocation
		want bool
	}{
		{"unrevoke after revoke", lift2, revoke1, true},
		{"replayed revoke after unrevoke", revoke1, lift2, false},
		{"revoke again", revoke3, lift2, true},
		{"itself", lift2, lift2, false},
		{"tie: revoke beats lift", revoke3, tie, true},
		{"tie: lift loses", tie, revoke3, false},
	} {
		if got := tt.r.Newer(tt.o); got != tt.want {
			t.Errorf("%s: Newer = %v, want %v", tt.name, got, tt.want)
		}
	}
	if revoke3.Newer(tieLater) == tieLater.Newer(revoke3) {
		t.Error("two revocations with one serial: neither or both are newer; want exactly one")
	}
	if got := NextRevocationSerial(time.Unix(0, 100), 500); got != 501 {
		t.Errorf("NextRevocationSerial behind the held serial = %d, want 501", got)
	}
	if got := NextRevocationSerial(time.Unix(0, 900), 500); got != 900 {
		t.Errorf("NextRevocationSerial = %d, want the time, 900", got)
	}
}
