package identity

import (
	"crypto/ed25519"
	"strings"
	"testing"
)

// TestKeyTextForms: each kind reads its own form and the bare form of
// earlier releases, and refuses the other kind with a message naming it.
func TestKeyTextForms(t *testing.T) {
	pub, _, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	node, auth, bare := EncodeNodeKey(pub), EncodeAuthorityKey(pub), EncodeKey(pub)
	if !strings.HasPrefix(node, "nodekey:") || !strings.HasPrefix(auth, "authkey:") {
		t.Fatalf("text forms %q, %q: want the nodekey: and authkey: prefixes", node, auth)
	}
	for _, tt := range []struct {
		name  string
		parse func(string) (ed25519.PublicKey, error)
		in    string
		err   string // "" for ok
	}{
		{"node key as node", ParseNodeKey, node, ""},
		{"bare as node", ParseNodeKey, bare, ""},
		{"node key with spaces", ParseNodeKey, " " + node + "\n", ""},
		{"authority key as node", ParseNodeKey, auth, "node key: authkey:... is an authority key, not a node key"},
		{"authority key as authority", ParseAuthorityKey, auth, ""},
		{"bare as authority", ParseAuthorityKey, bare, ""},
		{"node key as authority", ParseAuthorityKey, node, "authority key: nodekey:... is a node key, not an authority key"},
		{"unknown kind", ParseNodeKey, "gossipkey:" + bare, `node key: unknown key kind "gossipkey:" (want nodekey: or authkey:)`},
		{"short", ParseNodeKey, "nodekey:AAAA", "node key: 3 bytes, want 32"},
		{"either kind", ParsePublicKey, auth, ""},
		{"either kind, node", ParsePublicKey, node, ""},
	} {
		got, err := tt.parse(tt.in)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("%s: %v", tt.name, err)
		case tt.err == "" && !got.Equal(pub):
			t.Errorf("%s: parsed another key", tt.name)
		case tt.err != "" && (err == nil || err.Error() != tt.err):
			t.Errorf("%s: error %v, want %q", tt.name, err, tt.err)
		}
	}
}
