package identity

import (
	"bytes"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Signed revocations. A revocation made with the authority key is a
// statement any node can check, like an entry of a certificate revocation
// list: the authority says that a subject (a node name, or a node key) is
// revoked, or that its revocation is lifted. Statements about one subject
// are ordered by their Serial, which the authority raises with every
// statement it signs about that subject; the newest one holds (Newer).
// A node keeps the newest statement about each subject, the lifting ones
// too, so an older revocation replayed after an unrevoke is recognised as
// older and changes nothing.

// ErrBadRevocation is wrapped by every revocation statement that cannot be
// parsed or whose signature is not by a trusted authority.
var ErrBadRevocation = errors.New("bad revocation statement")

const (
	revocationVersion = 1
	revocationDomain  = "infermesh/revocation/v1\x00"

	revokeOp = 1 // the subject is revoked
	liftOp   = 2 // the subject's revocation is lifted

	subjectName = 1
	subjectKey  = 2

	revocationFixed = 1 + 1 + 1 + 8 + 8 + 1 // version, op, subject kind, serial, issued, subject length
)

// MaxRevocationLen bounds the binary form of a statement (Marshal).
const MaxRevocationLen = revocationFixed + MaxNodeNameLen + ed25519.SignatureSize

// Revocation is a revocation statement signed by a cluster authority: the
// subject (exactly one of Name and PublicKey) is revoked (Revoked) or no
// longer revoked, as of Serial.
type Revocation struct {
	// Name is the node name the statement is about; "" when it is about a key.
	Name string
	// PublicKey is the node key the statement is about; nil when it is
	// about a name.
	PublicKey ed25519.PublicKey
	// Revoked is true for a revocation, false for the lifting of one.
	Revoked bool
	// Serial orders the statements about one subject: a higher one is
	// newer. NextRevocationSerial picks it.
	Serial uint64
	// IssuedAt is when the authority signed it, to the second. It is
	// shown, never compared with this node's clock.
	IssuedAt time.Time
	// Signature by the authority over the other fields.
	Signature []byte
}

// ParseRevocationSubject reads what trust.revoked entries and
// `infermesh revoke` name: a node name or a base64 ed25519 public key.
// The two cannot be confused: a 32-byte key in base64 ends in '=', which
// no node name contains. Exactly one of name and key is set.
func ParseRevocationSubject(s string) (name string, key ed25519.PublicKey, err error) {
	s = strings.TrimSpace(s)
	if strings.HasSuffix(s, "=") || strings.Contains(s, ":") { // a key, never a name
		k, err := ParseNodeKey(s)
		if err != nil {
			return "", nil, fmt.Errorf("revocation subject %q: %w", s, err)
		}
		return "", k, nil
	}
	if err := ValidateNodeName(s); err != nil {
		return "", nil, fmt.Errorf("revocation subject %q: neither a node name nor a public key: %w", s, err)
	}
	return s, nil, nil
}

// NextRevocationSerial is the serial of a new statement about a subject
// whose newest known statement has serial held (0 for none): the issue
// time in nanoseconds, raised above held when the signer's clock is
// behind, so it is always newer than what the cluster holds.
func NextRevocationSerial(now time.Time, held uint64) uint64 {
	return max(uint64(now.UnixNano()), held+1)
}

// IssueRevocation signs a statement that subject (a node name or a base64
// public key, see ParseRevocationSubject) is revoked, or no longer revoked
// when revoked is false, as of serial.
func IssueRevocation(authority ed25519.PrivateKey, subject string, revoked bool, serial uint64, now time.Time) (*Revocation, error) {
	name, key, err := ParseRevocationSubject(subject)
	if err != nil {
		return nil, err
	}
	if serial == 0 {
		return nil, errors.New("revocation serial: must be positive")
	}
	r := &Revocation{Name: name, PublicKey: key, Revoked: revoked, Serial: serial, IssuedAt: now.Truncate(time.Second)}
	r.Signature = ed25519.Sign(authority, r.signedBytes())
	return r, nil
}

// Subject is what the statement is about, in the text form of
// trust.revoked: the node name, or the base64 public key.
func (r *Revocation) Subject() string {
	if r.PublicKey != nil {
		return EncodeKey(r.PublicKey)
	}
	return r.Name
}

// Op is "revoke" or "unrevoke".
func (r *Revocation) Op() string {
	if r.Revoked {
		return "revoke"
	}
	return "unrevoke"
}

func (r *Revocation) body() []byte {
	b := make([]byte, 0, MaxRevocationLen)
	op := byte(liftOp)
	if r.Revoked {
		op = revokeOp
	}
	kind, subject := byte(subjectName), []byte(r.Name)
	if r.PublicKey != nil {
		kind, subject = subjectKey, r.PublicKey
	}
	b = append(b, revocationVersion, op, kind)
	b = binary.BigEndian.AppendUint64(b, r.Serial)
	b = binary.BigEndian.AppendUint64(b, uint64(r.IssuedAt.Unix()))
	b = append(b, byte(len(subject)))
	return append(b, subject...)
}

func (r *Revocation) signedBytes() []byte {
	return append([]byte(revocationDomain), r.body()...)
}

// Marshal returns the binary form of the statement.
func (r *Revocation) Marshal() []byte {
	return append(r.body(), r.Signature...)
}

// String returns the text form (standard base64 of Marshal).
func (r *Revocation) String() string {
	return base64.StdEncoding.EncodeToString(r.Marshal())
}

// ParseRevocation parses the text form of a statement. It does not check
// the signature (see VerifyRevocation).
func ParseRevocation(s string) (*Revocation, error) {
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadRevocation, err)
	}
	return UnmarshalRevocation(b)
}

// UnmarshalRevocation parses the binary form (Marshal) of a statement.
// Like ParseRevocation it does not check the signature.
func UnmarshalRevocation(b []byte) (*Revocation, error) {
	if len(b) < revocationFixed+ed25519.SignatureSize {
		return nil, fmt.Errorf("%w: %d bytes, too short", ErrBadRevocation, len(b))
	}
	if b[0] != revocationVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrBadRevocation, b[0], revocationVersion)
	}
	r := &Revocation{}
	switch b[1] {
	case revokeOp:
		r.Revoked = true
	case liftOp:
	default:
		return nil, fmt.Errorf("%w: unknown operation %d", ErrBadRevocation, b[1])
	}
	r.Serial = binary.BigEndian.Uint64(b[3:11])
	r.IssuedAt = time.Unix(int64(binary.BigEndian.Uint64(b[11:19])), 0)
	n := int(b[revocationFixed-1])
	if len(b) != revocationFixed+n+ed25519.SignatureSize {
		return nil, fmt.Errorf("%w: length %d does not match subject length %d", ErrBadRevocation, len(b), n)
	}
	subject := b[revocationFixed : revocationFixed+n]
	switch b[2] {
	case subjectName:
		r.Name = string(subject)
		if err := ValidateNodeName(r.Name); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadRevocation, err)
		}
	case subjectKey:
		if n != ed25519.PublicKeySize {
			return nil, fmt.Errorf("%w: subject key of %d bytes, want %d", ErrBadRevocation, n, ed25519.PublicKeySize)
		}
		r.PublicKey = append(ed25519.PublicKey(nil), subject...)
	default:
		return nil, fmt.Errorf("%w: unknown subject kind %d", ErrBadRevocation, b[2])
	}
	if r.Serial == 0 {
		return nil, fmt.Errorf("%w: serial 0", ErrBadRevocation)
	}
	r.Signature = append([]byte(nil), b[revocationFixed+n:]...)
	return r, nil
}

// VerifyRevocation returns the authority key that signed r, or an error
// wrapping ErrBadRevocation when none of authorities did.
func VerifyRevocation(r *Revocation, authorities []ed25519.PublicKey) (ed25519.PublicKey, error) {
	msg := r.signedBytes()
	for _, a := range authorities {
		if ed25519.Verify(a, msg, r.Signature) {
			return a, nil
		}
	}
	if len(authorities) == 0 {
		return nil, fmt.Errorf("%w: no authority key configured", ErrBadRevocation)
	}
	return nil, fmt.Errorf("%w: not signed by a trusted authority", ErrBadRevocation)
}

// SameSubject reports whether r and o are about the same subject.
func (r *Revocation) SameSubject(o *Revocation) bool {
	return r.Name == o.Name && bytes.Equal(r.PublicKey, o.PublicKey)
}

// Newer reports whether r supersedes o, a statement about the same
// subject. The higher Serial is newer. At an equal serial (the authority
// signed two statements with one serial) a revocation is newer than a
// lifting, so the conflict fails closed, and between two statements of
// the same operation the greater signature is: a total order, so every
// node keeps the same statement whichever it heard first. A statement is
// not newer than itself.
func (r *Revocation) Newer(o *Revocation) bool {
	switch {
	case r.Serial != o.Serial:
		return r.Serial > o.Serial
	case r.Revoked != o.Revoked:
		return r.Revoked
	}
	return bytes.Compare(r.Signature, o.Signature) > 0
}
