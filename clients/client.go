package clients

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// Anonymous is the client of a request without a key (or, with
// require_key, of none: such a request is refused).
const Anonymous = "anonymous"

// KeyPrefix begins every key.
const KeyPrefix = "im-"

// keyBytes is a key's randomness.
const keyBytes = 32

// keyLen is the length of a key: the prefix and 32 bytes in base64url.
var keyLen = len(KeyPrefix) + base64.RawURLEncoding.EncodedLen(keyBytes)

// MaxNameLen bounds a client's name.
const MaxNameLen = 63

// Priority orders requests waiting for a slot: High before Normal before
// Low, first in first out within each.
type Priority int8

const (
	Low    Priority = -1
	Normal Priority = 0
	High   Priority = 1
)

func (p Priority) String() string {
	switch p {
	case High:
		return "high"
	case Low:
		return "low"
	}
	return "normal"
}

// ParsePriority reads high, normal or low ("" is normal).
func ParsePriority(s string) (Priority, error) {
	switch s {
	case "", "normal":
		return Normal, nil
	case "high":
		return High, nil
	case "low":
		return Low, nil
	}
	return Normal, fmt.Errorf("priority %q is not high, normal or low", s)
}

// Limits are a client's limits; 0 is none.
type Limits struct {
	RPM           int64 `json:"rpm,omitempty" yaml:"rpm"`
	TPM           int64 `json:"tpm,omitempty" yaml:"tpm"`
	MaxConcurrent int64 `json:"max_concurrent,omitempty" yaml:"max_concurrent"`
}

// Validate names a negative limit.
func (l Limits) Validate() error {
	for _, f := range []struct {
		name string
		v    int64
	}{{"rpm", l.RPM}, {"tpm", l.TPM}, {"max_concurrent", l.MaxConcurrent}} {
		if f.v < 0 {
			return fmt.Errorf("%s %d is negative (0 is no limit)", f.name, f.v)
		}
	}
	return nil
}

// Client is one client as the Registry holds it.
type Client struct {
	Name string
	// KeyHash is the hash of its key (HashKey); zero when it has none (a
	// client known by its Unix credentials only, or Anonymous).
	KeyHash [sha256.Size]byte
	// UID, when HasUID, and Unit, when not empty, name the callers on the
	// proxy's Unix socket that are this client.
	UID    uint32
	HasUID bool
	Unit   string
	// Roles it may use; empty: every role.
	Roles    []string
	Priority Priority
	Limits
}

// HasKey reports whether c has a key.
func (c *Client) HasKey() bool { return c.KeyHash != [sha256.Size]byte{} }

// Allows reports whether c may use role.
func (c *Client) Allows(role string) bool {
	if len(c.Roles) == 0 {
		return true
	}
	for _, r := range c.Roles {
		if r == role {
			return true
		}
	}
	return false
}

// NewKey returns a new key.
func NewKey() (string, error) {
	var b [keyBytes]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("client key: %w", err)
	}
	return KeyPrefix + base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// HashKey is the hash a key is kept as.
func HashKey(key string) [sha256.Size]byte { return sha256.Sum256([]byte(key)) }

// HashString is h in hex, as the state store keeps it.
func HashString(h [sha256.Size]byte) string { return hex.EncodeToString(h[:]) }

// ParseHash reads a hash HashString wrote.
func ParseHash(s string) ([sha256.Size]byte, error) {
	var h [sha256.Size]byte
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != sha256.Size {
		return h, errors.New("not a hex SHA-256")
	}
	copy(h[:], b)
	return h, nil
}

// KeyHint is what a list shows of a key: its last four characters, enough
// to tell keys apart, too few to guess the rest.
func KeyHint(key string) string {
	if len(key) < 8 {
		return ""
	}
	return KeyPrefix + "…" + key[len(key)-4:]
}

// LooksLikeKey reports whether s has a key's form (prefix and length).
func LooksLikeKey(s string) bool { return len(s) == keyLen && strings.HasPrefix(s, KeyPrefix) }

// ErrBadName is wrapped by ValidateName's errors.
var ErrBadName = errors.New("invalid client name")

// ValidateName checks a client's name: 1 to 63 bytes of [A-Za-z0-9._-],
// starting with a letter or digit, and not Anonymous (which the config's
// proxy.anonymous describes).
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrBadName)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w %.16q...: longer than %d bytes", ErrBadName, name, MaxNameLen)
	case name == Anonymous:
		return fmt.Errorf("%w %q: reserved for requests without a key (its limits are proxy.anonymous in the config)", ErrBadName, name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return fmt.Errorf("%w %q: character %q at %d (a name is [A-Za-z0-9._-], starting with a letter or digit)", ErrBadName, name, c, i)
		}
	}
	return nil
}

// ValidName reports whether name is a registered client's name or
// Anonymous: what a serving node accepts as the name a peer sends.
func ValidName(name string) bool { return name == Anonymous || ValidateName(name) == nil }
