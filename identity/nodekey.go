package identity

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// NodeKeyFile is the name of the node key file inside the state dir.
const NodeKeyFile = "node.key"

// MaxNodeNameLen is the longest node name accepted (a DNS label's 63: a
// node name is also a Docker label and container-name part).
const MaxNodeNameLen = 63

// ErrKeyFile is wrapped by every problem with an existing key file: it is
// unreadable, corrupt, or readable by group or others. A key file is never
// replaced silently.
var ErrKeyFile = errors.New("bad key file")

// ValidateNodeName is the one rule of node names, in the agent, the CLI,
// certificates, revocations and gossip alike (site and cluster names follow
// it too): 1 to MaxNodeNameLen bytes of [A-Za-z0-9._-], starting with a
// letter or digit. Such a name is safe in allowlists, logs, paths, Docker
// labels and container names, and cannot be "." or "..".
func ValidateNodeName(name string) error {
	ok := name != "" && len(name) <= MaxNodeNameLen && isAlnum(name[0])
	for i := 1; ok && i < len(name); i++ {
		c := name[i]
		ok = isAlnum(c) || c == '.' || c == '_' || c == '-'
	}
	if !ok {
		return fmt.Errorf("%q is not a valid name (letters, digits, '.', '_', '-'; at most %d; starting with a letter or digit)", name, MaxNodeNameLen)
	}
	return nil
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// EncodeKey returns the bare text form (standard base64) of a public key,
// without its kind: for stored records. What people read and paste is
// EncodeNodeKey or EncodeAuthorityKey.
func EncodeKey(pub ed25519.PublicKey) string {
	return base64.StdEncoding.EncodeToString(pub)
}

// LoadOrCreateKey returns the ed25519 private key stored at path, creating
// it (mode 0600, written atomically) when the file does not exist. created
// reports whether a new key was made. An existing file that is unreadable,
// corrupt, or accessible to group or others is an error wrapping
// ErrKeyFile; it is never regenerated.
func LoadOrCreateKey(path string) (key ed25519.PrivateKey, created bool, err error) {
	key, err = LoadKey(path)
	if err == nil {
		return key, false, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, false, err
	}
	_, key, err = ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, false, fmt.Errorf("generate key: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, false, fmt.Errorf("create key dir: %w", err)
	}
	if err := writeFileExclusive(path, []byte(encodePrivate(key)+"\n")); err != nil {
		if errors.Is(err, fs.ErrExist) {
			// Another process created it between our read and write: use theirs.
			key, err = LoadKey(path)
			return key, false, err
		}
		return nil, false, err
	}
	return key, true, nil
}

// LoadKey reads an ed25519 private key written by LoadOrCreateKey or
// WriteNewKey. A missing file wraps fs.ErrNotExist; every other problem
// wraps ErrKeyFile.
func LoadKey(path string) (ed25519.PrivateKey, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("%w %s: %w%s", ErrKeyFile, path, err, ownerHint(path, err))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w %s: %w", ErrKeyFile, path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w %s: not a regular file", ErrKeyFile, path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%w %s: mode %04o, want 0600 (no group or other access)", ErrKeyFile, path, perm)
	}
	buf, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return nil, fmt.Errorf("%w %s: %w", ErrKeyFile, path, err)
	}
	key, err := decodePrivate(string(buf))
	if err != nil {
		return nil, fmt.Errorf("%w %s: %w", ErrKeyFile, path, err)
	}
	return key, nil
}

// WriteNewKey creates a new key file at path (mode 0600, atomically) and
// fails with an error wrapping fs.ErrExist when a file is already there.
func WriteNewKey(path string) (ed25519.PrivateKey, error) {
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	if err := writeFileExclusive(path, []byte(encodePrivate(key)+"\n")); err != nil {
		return nil, err
	}
	return key, nil
}

// encodePrivate is the text form of a private key: base64 of its 32-byte seed.
func encodePrivate(key ed25519.PrivateKey) string {
	return base64.StdEncoding.EncodeToString(key.Seed())
}

func decodePrivate(s string) (ed25519.PrivateKey, error) {
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("corrupt key: %w", err)
	}
	if len(b) != ed25519.SeedSize {
		return nil, fmt.Errorf("corrupt key: %d bytes, want a %d-byte seed", len(b), ed25519.SeedSize)
	}
	return ed25519.NewKeyFromSeed(b), nil
}

// ownerHint explains a permission error on a file of another user: a key
// made by root (sudo) for an agent that runs as its own user.
func ownerHint(path string, err error) string {
	if !errors.Is(err, fs.ErrPermission) {
		return ""
	}
	st, serr := os.Stat(path)
	if serr != nil {
		return ""
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || int(sys.Uid) == os.Geteuid() {
		return ""
	}
	return fmt.Sprintf(" (it belongs to uid %d and this process runs as uid %d: chown it to the user the agent runs as)", sys.Uid, os.Geteuid())
}

// PublicKeyFingerprint names an ed25519 public key (a node's, the
// authority's) short enough to compare by eye, in the one fingerprint form
// of the project (16 hex digits, as gossip keys are named), hashed in its
// own domain so that it never equals a gossip key's.
func PublicKeyFingerprint(pub ed25519.PublicKey) Fingerprint {
	h := sha256.New()
	h.Write([]byte("infermesh/public-key-fp/v1\x00"))
	h.Write(pub)
	var fp Fingerprint
	copy(fp[:], h.Sum(nil))
	return fp
}
