package mesh

import (
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/infermesh/infermesh/identity"
)

// TrustedNode is a node admitted by static configuration.
type TrustedNode struct {
	Name      string
	PublicKey ed25519.PublicKey
	// Scope is what the node may do; 0 means identity.ScopeFull.
	Scope identity.Scope
}

// TrustConfig says which nodes are admitted. A node is admitted when it is
// not revoked and either a static entry lists its (name, key) or it presents
// an admission certificate for its (name, key), signed by one of the
// Authorities and not expired. A static entry pins the key for its name: a
// certificate for another key under that name is not enough.
type TrustConfig struct {
	// Authorities are the cluster authority public keys; several allow an
	// authority rotation.
	Authorities []ed25519.PublicKey
	// Nodes are the statically trusted nodes.
	Nodes []TrustedNode
	// Revoked lists node names and base64 public keys that are never
	// admitted, whatever vouches for them.
	Revoked []string
}

// ErrRevokedByConfig is returned by Unrevoke for a revocation that comes
// from the trust configuration: only a new configuration lifts it.
var ErrRevokedByConfig = errors.New("revoked by the trust configuration")

// revocation is a parsed Revoked entry: a node name or a public key.
type revocation struct {
	name string
	key  string // raw key bytes as a string; "" for a name
}

// parseRevocation reads a node name or a base64 ed25519 public key. The two
// cannot be confused: a 32-byte key in base64 ends in '=', which no node
// name contains.
func parseRevocation(s string) (revocation, error) {
	s = strings.TrimSpace(s)
	if strings.HasSuffix(s, "=") || strings.Contains(s, ":") { // a key, never a name
		k, err := identity.ParseNodeKey(s)
		if err != nil {
			return revocation{}, fmt.Errorf("revocation %q: %w", s, err)
		}
		return revocation{key: string(k)}, nil
	}
	if err := identity.ValidateNodeName(s); err != nil {
		return revocation{}, fmt.Errorf("revocation %q: neither a node name nor a public key: %w", s, err)
	}
	return revocation{name: s}, nil
}

func (r revocation) String() string {
	if r.key != "" {
		return base64.StdEncoding.EncodeToString([]byte(r.key))
	}
	return r.name
}

// trustState is an immutable, validated TrustConfig plus the run-time
// revocations. It is replaced as a whole, so readers need no lock beyond
// loading the pointer.
type trustState struct {
	authorities []ed25519.PublicKey
	static      map[string]TrustedNode
	config      map[revocation]bool // revoked by configuration
	runtime     map[revocation]bool // revoked at run time (Revoke)
	// signed are the subjects a statement signed by one of authorities
	// revokes now (the newest held about each: revocations.go).
	signed map[revocation]*heldRevocation

	// verdicts remembers certOK's answers for this set of authorities:
	// memberlist asks the alive delegate about every copy of every alive
	// message and every member of every push/pull, and a signature check
	// per ask was most of a forming mesh's CPU.
	verdicts *certVerdicts
}

// certVerdicts maps a certificate's full binary form to whether it
// verified. Safe for concurrent use. byPtr answers first, without
// building the binary form: the certificates asked about come from the
// node meta cache, the same parsed value for every copy of a node's meta
// (and a Certificate is not modified once parsed).
type certVerdicts struct {
	mu    sync.Mutex
	m     map[string]bool
	byPtr map[*identity.Certificate]bool
}

// certVerdictsMax bounds the cache; it is emptied when full.
const certVerdictsMax = 4096

func newTrustState(c TrustConfig, runtime map[revocation]bool) (*trustState, error) {
	t := &trustState{
		static:   make(map[string]TrustedNode, len(c.Nodes)),
		config:   make(map[revocation]bool, len(c.Revoked)),
		runtime:  runtime,
		verdicts: &certVerdicts{m: map[string]bool{}, byPtr: map[*identity.Certificate]bool{}},
	}
	if t.runtime == nil {
		t.runtime = map[revocation]bool{}
	}
	for i, a := range c.Authorities {
		if len(a) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("Trust.Authorities[%d]: %d bytes, want %d", i, len(a), ed25519.PublicKeySize)
		}
		t.authorities = append(t.authorities, append(ed25519.PublicKey(nil), a...))
	}
	for i, n := range c.Nodes {
		if err := identity.ValidateNodeName(n.Name); err != nil {
			return nil, fmt.Errorf("Trust.Nodes[%d]: %w", i, err)
		}
		if len(n.PublicKey) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("Trust.Nodes[%d] (%s): public key: %d bytes, want %d", i, n.Name, len(n.PublicKey), ed25519.PublicKeySize)
		}
		if n.Scope == 0 {
			n.Scope = identity.ScopeFull
		}
		if n.Scope != identity.ScopeFull && n.Scope != identity.ScopeConsumer {
			return nil, fmt.Errorf("Trust.Nodes[%d] (%s): scope %v: want full or consumer", i, n.Name, n.Scope)
		}
		if _, dup := t.static[n.Name]; dup {
			return nil, fmt.Errorf("Trust.Nodes[%d]: node %q listed twice", i, n.Name)
		}
		n.PublicKey = append(ed25519.PublicKey(nil), n.PublicKey...)
		t.static[n.Name] = n
	}
	for i, s := range c.Revoked {
		r, err := parseRevocation(s)
		if err != nil {
			return nil, fmt.Errorf("Trust.Revoked[%d]: %w", i, err)
		}
		t.config[r] = true
	}
	return t, nil
}

// withRuntime returns a copy of t with the run-time revocations replaced.
func (t *trustState) withRuntime(runtime map[revocation]bool) *trustState {
	c := *t
	c.runtime = runtime
	return &c
}

// withSigned returns a copy of t with the signed revocations in force
// replaced.
func (t *trustState) withSigned(signed map[revocation]*heldRevocation) *trustState {
	c := *t
	c.signed = signed
	return &c
}

func (t *trustState) revoked(name string, key ed25519.PublicKey) bool {
	n, k := revocation{name: name}, revocation{key: string(key)}
	return t.config[n] || t.config[k] || t.runtime[n] || t.runtime[k] || t.signed[n] != nil || t.signed[k] != nil
}

// revocationEvidence names what revokes (name, key), "" when nothing
// does: the configuration, this node's operator, or a statement signed
// by an authority (which one, and its serial).
func (t *trustState) revocationEvidence(name string, key ed25519.PublicKey) string {
	n, k := revocation{name: name}, revocation{key: string(key)}
	for _, r := range []revocation{n, k} {
		switch {
		case t.config[r]:
			return fmt.Sprintf("%s is in trust.revoked", r)
		case t.signed[r] != nil:
			h := t.signed[r]
			return fmt.Sprintf("%s is revoked by a statement signed by authority %s (serial %d)", r, identity.EncodeAuthorityKey(h.signer), h.r.Serial)
		case t.runtime[r]:
			return fmt.Sprintf("%s is revoked on this node (infermesh revoke)", r)
		}
	}
	return ""
}

// Admission refusal reasons (also refusal counter keys).
const (
	whyRevoked       = "revoked"
	whyNotTrusted    = "not_trusted"
	whyKeyMismatch   = "key_mismatch"
	whyCertSignature = "bad_certificate"
	whyCertOther     = "certificate_for_other_node"
	whyCertExpired   = "certificate_expired"
)

// admit decides whether (name, key) is admitted at now, given the
// certificate it presented (nil for none) and whether that certificate's
// signature verified against t's authorities. It returns the scope, or 0
// and the reason.
func (t *trustState) admit(name string, key ed25519.PublicKey, cert *identity.Certificate, certOK bool, now time.Time) (identity.Scope, string) {
	if t.revoked(name, key) {
		return 0, whyRevoked
	}
	if s, ok := t.static[name]; ok {
		if !s.PublicKey.Equal(key) {
			return 0, whyKeyMismatch
		}
		return s.Scope, ""
	}
	if cert == nil {
		return 0, whyNotTrusted
	}
	switch {
	case !certOK:
		return 0, whyCertSignature
	case cert.Name != name || !cert.PublicKey.Equal(key):
		return 0, whyCertOther
	case !now.Before(cert.Expires):
		return 0, whyCertExpired
	}
	return cert.Scope, ""
}

// certOK verifies cert against t's authorities; nil is not OK.
func (t *trustState) certOK(cert *identity.Certificate) bool {
	if cert == nil {
		return false
	}
	v := t.verdicts
	v.mu.Lock()
	ok, known := v.byPtr[cert]
	v.mu.Unlock()
	if known {
		return ok
	}
	k := string(cert.Marshal())
	v.mu.Lock()
	ok, known = v.m[k]
	v.mu.Unlock()
	if !known {
		ok = identity.VerifyCertificate(cert, t.authorities) == nil
	}
	v.mu.Lock()
	if len(v.m) >= certVerdictsMax || len(v.byPtr) >= certVerdictsMax {
		clear(v.m)
		clear(v.byPtr)
	}
	v.m[k] = ok
	v.byPtr[cert] = ok
	v.mu.Unlock()
	return ok
}
