package identity

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Scope is what an admitted node may do.
type Scope uint8

// Scopes. The zero Scope is invalid.
const (
	// ScopeFull nodes may consume and serve roles.
	ScopeFull Scope = 1
	// ScopeConsumer nodes may only consume: their adverts are never heard.
	ScopeConsumer Scope = 2
)

func (s Scope) String() string {
	switch s {
	case ScopeFull:
		return "full"
	case ScopeConsumer:
		return "consumer"
	default:
		return fmt.Sprintf("Scope(%d)", uint8(s))
	}
}

// ParseScope parses "full" or "consumer".
func ParseScope(s string) (Scope, error) {
	switch s {
	case "full":
		return ScopeFull, nil
	case "consumer":
		return ScopeConsumer, nil
	}
	return 0, fmt.Errorf("scope %q: want full or consumer", s)
}

// ErrBadCertificate is wrapped by every certificate that cannot be parsed
// or whose signature is not by a trusted authority.
var ErrBadCertificate = errors.New("bad admission certificate")

const (
	certVersion = 1
	certDomain  = "infermesh/admission-cert/v1\x00"
)

// MaxCertLen bounds the binary form of a certificate (Marshal), which
// travels in node meta.
const MaxCertLen = 2 + 8 + 8 + ed25519.PublicKeySize + 1 + MaxNodeNameLen + ed25519.SignatureSize

// Certificate is an admission certificate: the cluster authority vouches
// that the node Name owns PublicKey with Scope until Expires.
type Certificate struct {
	Name      string
	PublicKey ed25519.PublicKey
	Scope     Scope
	IssuedAt  time.Time
	Expires   time.Time
	// Signature by the authority over the other fields.
	Signature []byte
}

// IssueCertificate signs a certificate for (name, pub, scope) valid for ttl
// from now with the authority key.
func IssueCertificate(authority ed25519.PrivateKey, name string, pub ed25519.PublicKey, scope Scope, ttl time.Duration, now time.Time) (*Certificate, error) {
	if err := ValidateNodeName(name); err != nil {
		return nil, err
	}
	if len(pub) != ed25519.PublicKeySize {
		return nil, fmt.Errorf("public key: %d bytes, want %d", len(pub), ed25519.PublicKeySize)
	}
	if scope != ScopeFull && scope != ScopeConsumer {
		return nil, fmt.Errorf("scope %v: want full or consumer", scope)
	}
	if ttl <= 0 {
		return nil, fmt.Errorf("ttl %v: must be positive", ttl)
	}
	c := &Certificate{
		Name:      name,
		PublicKey: append(ed25519.PublicKey(nil), pub...),
		Scope:     scope,
		IssuedAt:  now.Truncate(time.Second),
		Expires:   now.Add(ttl).Truncate(time.Second),
	}
	c.Signature = ed25519.Sign(authority, c.signedBytes())
	return c, nil
}

// body is the encoded certificate without its signature.
func (c *Certificate) body() []byte {
	b := make([]byte, 0, MaxCertLen)
	b = append(b, certVersion, byte(c.Scope))
	b = binary.BigEndian.AppendUint64(b, uint64(c.IssuedAt.Unix()))
	b = binary.BigEndian.AppendUint64(b, uint64(c.Expires.Unix()))
	b = append(b, c.PublicKey...)
	b = append(b, byte(len(c.Name)))
	return append(b, c.Name...)
}

func (c *Certificate) signedBytes() []byte {
	return append([]byte(certDomain), c.body()...)
}

// Marshal returns the binary form of the certificate.
func (c *Certificate) Marshal() []byte {
	return append(c.body(), c.Signature...)
}

// String returns the text form (standard base64 of Marshal).
func (c *Certificate) String() string {
	return base64.StdEncoding.EncodeToString(c.Marshal())
}

// ParseCertificate parses the text form of a certificate. It does not check
// the signature (see VerifyCertificate).
func ParseCertificate(s string) (*Certificate, error) {
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadCertificate, err)
	}
	return UnmarshalCertificate(b)
}

// UnmarshalCertificate parses the binary form (Marshal) of a certificate.
// Like ParseCertificate it does not check the signature.
func UnmarshalCertificate(b []byte) (*Certificate, error) {
	const fixed = 2 + 8 + 8 + ed25519.PublicKeySize + 1
	if len(b) < fixed+ed25519.SignatureSize {
		return nil, fmt.Errorf("%w: %d bytes, too short", ErrBadCertificate, len(b))
	}
	if b[0] != certVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrBadCertificate, b[0], certVersion)
	}
	c := &Certificate{Scope: Scope(b[1])}
	if c.Scope != ScopeFull && c.Scope != ScopeConsumer {
		return nil, fmt.Errorf("%w: unknown scope %d", ErrBadCertificate, b[1])
	}
	c.IssuedAt = time.Unix(int64(binary.BigEndian.Uint64(b[2:10])), 0)
	c.Expires = time.Unix(int64(binary.BigEndian.Uint64(b[10:18])), 0)
	c.PublicKey = append(ed25519.PublicKey(nil), b[18:18+ed25519.PublicKeySize]...)
	n := int(b[fixed-1])
	if len(b) != fixed+n+ed25519.SignatureSize {
		return nil, fmt.Errorf("%w: length %d does not match name length %d", ErrBadCertificate, len(b), n)
	}
	c.Name = string(b[fixed : fixed+n])
	if err := ValidateNodeName(c.Name); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadCertificate, err)
	}
	c.Signature = append([]byte(nil), b[fixed+n:]...)
	return c, nil
}

// VerifyCertificate reports whether one of the authority keys signed c. It
// does not check expiry: admission does, at every check.
func VerifyCertificate(c *Certificate, authorities []ed25519.PublicKey) error {
	msg := c.signedBytes()
	for _, a := range authorities {
		if ed25519.Verify(a, msg, c.Signature) {
			return nil
		}
	}
	if len(authorities) == 0 {
		return fmt.Errorf("%w: no authority key configured", ErrBadCertificate)
	}
	return fmt.Errorf("%w: not signed by a trusted authority", ErrBadCertificate)
}
