package identity

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// GossipKeySize is the size of a gossip key: AES-256.
const GossipKeySize = 32

// MaxGossipKeys bounds a keyring (each key's fingerprint travels in node
// meta so that the mesh can count the nodes holding it).
const MaxGossipKeys = 8

// NewGossipKey returns a fresh random gossip key in text form.
func NewGossipKey() (string, error) {
	k := make([]byte, GossipKeySize)
	if _, err := rand.Read(k); err != nil {
		return "", fmt.Errorf("generate gossip key: %w", err)
	}
	return EncodeGossipKey(k), nil
}

// EncodeGossipKey returns the text form (standard base64) of a gossip key.
func EncodeGossipKey(k []byte) string {
	return base64.StdEncoding.EncodeToString(k)
}

// ParseGossipKey parses the text form of a gossip key.
func ParseGossipKey(s string) ([]byte, error) {
	k, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("gossip key: %w", err)
	}
	if len(k) != GossipKeySize {
		return nil, fmt.Errorf("gossip key: %d bytes, want %d (AES-256)", len(k), GossipKeySize)
	}
	return k, nil
}

// Fingerprint names a gossip key without revealing it: in node meta (so
// nodes can count who holds which key), in the admin API, the CLI and the
// audit log. It is the one fingerprint of a key everywhere.
type Fingerprint [8]byte

// String is the text form: 16 lowercase hex digits.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// GossipKeyFingerprint returns the fingerprint of gossip key k: the first 8
// bytes of a domain-separated SHA-256 of the key, so the hash cannot be
// mistaken for (or replayed as) a hash of the key in any other protocol.
func GossipKeyFingerprint(k []byte) Fingerprint {
	h := sha256.New()
	h.Write([]byte("infermesh/gossip-key-fp/v1\x00"))
	h.Write(k)
	var fp Fingerprint
	copy(fp[:], h.Sum(nil))
	return fp
}

// WriteNewKeyring creates a keyring file at path holding one fresh key and
// returns that key. An existing file is an error wrapping fs.ErrExist.
func WriteNewKeyring(path string) (string, error) {
	k, err := NewGossipKey()
	if err != nil {
		return "", err
	}
	data, _ := json.Marshal([]string{k})
	if err := writeFileExclusive(path, append(data, '\n')); err != nil {
		return "", err
	}
	return k, nil
}

// WriteKeyringFile creates a keyring file at path (mode 0600) holding keys
// (text form, the primary first), as LoadKeyring reads it. An existing
// file is an error wrapping fs.ErrExist.
func WriteKeyringFile(path string, keys []string) error {
	if len(keys) == 0 || len(keys) > MaxGossipKeys {
		return fmt.Errorf("gossip keyring %s: %d keys, want 1 to %d", path, len(keys), MaxGossipKeys)
	}
	for i, k := range keys {
		if _, err := ParseGossipKey(k); err != nil {
			return fmt.Errorf("gossip keyring %s: key %d: %w", path, i, err)
		}
	}
	data, _ := json.Marshal(keys)
	return writeFileExclusive(path, append(data, '\n'))
}

// LoadKeyring reads a keyring file: a JSON list of base64 AES-256 keys, the
// first being the primary. The file must not be accessible to group or
// others. Errors wrap fs.ErrNotExist when it is missing.
func LoadKeyring(path string) ([][]byte, error) {
	st, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("gossip keyring %s: %w", path, err)
		}
		return nil, fmt.Errorf("gossip keyring: %w", err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("gossip keyring %s: mode %04o, want 0600 (no group or other access)", path, perm)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("gossip keyring: %w", err)
	}
	var texts []string
	if err := json.Unmarshal(data, &texts); err != nil {
		return nil, fmt.Errorf("gossip keyring %s: want a JSON list of base64 keys: %w", path, err)
	}
	if len(texts) == 0 {
		return nil, fmt.Errorf("gossip keyring %s: no keys", path)
	}
	if len(texts) > MaxGossipKeys {
		return nil, fmt.Errorf("gossip keyring %s: %d keys, at most %d", path, len(texts), MaxGossipKeys)
	}
	keys := make([][]byte, 0, len(texts))
	seen := map[string]bool{}
	for i, t := range texts {
		k, err := ParseGossipKey(t)
		if err != nil {
			return nil, fmt.Errorf("gossip keyring %s: key %d: %w", path, i, err)
		}
		if seen[string(k)] {
			return nil, fmt.Errorf("gossip keyring %s: key %d listed twice", path, i)
		}
		seen[string(k)] = true
		keys = append(keys, k)
	}
	return keys, nil
}

// SaveKeyring writes keys (primary first) to path atomically, mode 0600,
// replacing the file.
func SaveKeyring(path string, keys [][]byte) error {
	texts := make([]string, len(keys))
	for i, k := range keys {
		texts[i] = EncodeGossipKey(k)
	}
	data, err := json.Marshal(texts)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, append(data, '\n'))
}
