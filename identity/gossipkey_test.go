package identity

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
)

func TestLoadKeyring(t *testing.T) {
	dir := t.TempDir()
	k1, _ := NewGossipKey()
	k2, _ := NewGossipKey()
	tests := []struct {
		name    string
		content string
		mode    os.FileMode
		want    int
	}{
		{"two keys", `["` + k1 + `","` + k2 + `"]`, 0o600, 2},
		{"group readable", `["` + k1 + `"]`, 0o640, -1},
		{"empty list", `[]`, 0o600, -1},
		{"not json", `nope`, 0o600, -1},
		{"short key", `["AAAA"]`, 0o600, -1},
		{"duplicate", `["` + k1 + `","` + k1 + `"]`, 0o600, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(dir, tt.name)
			if err := os.WriteFile(p, []byte(tt.content), tt.mode); err != nil {
				t.Fatal(err)
			}
			os.Chmod(p, tt.mode)
			keys, err := LoadKeyring(p)
			if tt.want < 0 {
				if err == nil {
					t.Fatalf("LoadKeyring = %d keys, want an error", len(keys))
				}
				return
			}
			if err != nil || len(keys) != tt.want {
				t.Fatalf("LoadKeyring = %d keys, %v; want %d", len(keys), err, tt.want)
			}
		})
	}
}

// TestGossipKeyFingerprint pins the fingerprint: it travels in node meta,
// so a change would make nodes of two versions miscount who holds a key.
func TestGossipKeyFingerprint(t *testing.T) {
	tests := []struct {
		key  string
		want string
	}{
		{"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "76c189a1b08e8a14"},
		{"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=", "9470041946979db4"},
	}
	for _, tt := range tests {
		k, err := ParseGossipKey(tt.key)
		if err != nil {
			t.Fatal(err)
		}
		if got := GossipKeyFingerprint(k).String(); got != tt.want {
			t.Errorf("GossipKeyFingerprint(%s) = %s, want %s", tt.key, got, tt.want)
		}
		// Domain-separated: not the plain SHA-256 of the key.
		plain := sha256.Sum256(k)
		if hex.EncodeToString(plain[:8]) == tt.want {
			t.Errorf("GossipKeyFingerprint(%s) is the plain SHA-256 prefix", tt.key)
		}
	}
}
