package identity

import (
	"crypto/ed25519"
	"encoding/base64"
	"fmt"
	"strings"
)

// Node keys and authority keys are both ed25519 public keys. Their text
// forms carry the kind, so that one pasted where the other belongs is
// refused with a message that names it (tailscale's "nodekey:" is the
// model): a node key is "nodekey:<base64>", an authority key
// "authkey:<base64>". The bare base64 form of earlier releases is still
// read as either kind.
const (
	NodeKeyPrefix      = "nodekey:"
	AuthorityKeyPrefix = "authkey:"
)

// EncodeNodeKey returns the text form of a node's public key.
func EncodeNodeKey(pub ed25519.PublicKey) string { return NodeKeyPrefix + EncodeKey(pub) }

// EncodeAuthorityKey returns the text form of an authority's public key
// (the value of trust.authority).
func EncodeAuthorityKey(pub ed25519.PublicKey) string {
	return AuthorityKeyPrefix + EncodeKey(pub)
}

// ParseNodeKey parses a node's public key: "nodekey:<base64>" or bare
// base64. An authority key ("authkey:") is refused, naming what it is.
func ParseNodeKey(s string) (ed25519.PublicKey, error) {
	return parseKey(s, NodeKeyPrefix, AuthorityKeyPrefix, "node key", "a node key", "an authority key")
}

// ParseAuthorityKey parses an authority's public key: "authkey:<base64>"
// or bare base64. A node key ("nodekey:") is refused, naming what it is.
func ParseAuthorityKey(s string) (ed25519.PublicKey, error) {
	return parseKey(s, AuthorityKeyPrefix, NodeKeyPrefix, "authority key", "an authority key", "a node key")
}

// ParsePublicKey parses a public key of either kind, in any of the three
// forms: for keys whose kind the context already fixes (stored records).
func ParsePublicKey(s string) (ed25519.PublicKey, error) {
	s = strings.TrimSpace(s)
	if rest, ok := strings.CutPrefix(s, NodeKeyPrefix); ok {
		s = rest
	} else if rest, ok := strings.CutPrefix(s, AuthorityKeyPrefix); ok {
		s = rest
	}
	return decodeKey(s, "public key")
}

func parseKey(s, want, other, what, aWhat, aOther string) (ed25519.PublicKey, error) {
	s = strings.TrimSpace(s)
	if strings.HasPrefix(s, other) {
		return nil, fmt.Errorf("%s: %s... is %s, not %s", what, other, aOther, aWhat)
	}
	s, _ = strings.CutPrefix(s, want)
	return decodeKey(s, what)
}

func decodeKey(s, what string) (ed25519.PublicKey, error) {
	if i := strings.IndexByte(s, ':'); i >= 0 {
		return nil, fmt.Errorf("%s: unknown key kind %q (want %s or %s)", what, s[:i+1], NodeKeyPrefix, AuthorityKeyPrefix)
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if len(b) != ed25519.PublicKeySize {
		return nil, fmt.Errorf("%s: %d bytes, want %d", what, len(b), ed25519.PublicKeySize)
	}
	return ed25519.PublicKey(b), nil
}
