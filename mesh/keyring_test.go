package mesh

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
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

func TestKeyringRotation(t *testing.T) {
	c := newTestCluster(t)
	// Each node needs its own keyring file: changes are persisted.
	mk := func(name string) *testNode {
		cfg := c.config(name)
		cfg.KeyringPath = filepath.Join(c.root, name+"-keyring.json")
		data, err := os.ReadFile(c.keyring)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cfg.KeyringPath, data, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg.Certificate = c.certFor(cfg, ScopeFull, time.Hour)
		return c.start(cfg)
	}
	a, b := mk("a"), mk("b")
	b.join(t, a)
	eventually(t, 5*time.Second, "a sees b", func() bool { return len(a.m.Members()) == 2 })
	old, _ := a.m.ListKeys()
	newKey, _ := NewGossipKey()

	for _, n := range []*testNode{a, b} {
		if err := n.m.InstallKey(newKey); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 5*time.Second, "both nodes hold the new key", func() bool {
		keys, members := a.m.ListKeys()
		return members == 2 && len(keys) == 2 && keys[1].Key == newKey && keys[1].Nodes == 2 && keys[0].Primary
	})
	for _, n := range []*testNode{a, b} {
		if err := n.m.UseKey(newKey); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.m.RemoveKey(newKey); !errors.Is(err, ErrPrimaryKey) {
		t.Errorf("RemoveKey(primary) = %v, want ErrPrimaryKey", err)
	}
	for _, n := range []*testNode{a, b} {
		if err := n.m.RemoveKey(old[0].Key); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.m.RemoveKey(old[0].Key); !errors.Is(err, ErrKeyNotInstalled) {
		t.Errorf("RemoveKey(removed) = %v, want ErrKeyNotInstalled", err)
	}
	keys, _ := a.m.ListKeys()
	if len(keys) != 1 || keys[0].Key != newKey || !keys[0].Primary {
		t.Errorf("keys after rotation = %+v, want only the new key, primary", keys)
	}
	onDisk, err := LoadKeyring(a.m.cfg.KeyringPath)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := ParseGossipKey(newKey)
	if len(onDisk) != 1 || !slices.Equal(onDisk[0], want) {
		t.Errorf("persisted keyring = %d keys, want the new key only", len(onDisk))
	}
	// The mesh still works on the new key: a change still propagates.
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "")
	eventually(t, 5*time.Second, "a resolves chat to b after rotation", func() bool { return a.resolvesTo("chat", "b") })
}
