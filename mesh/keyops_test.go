package mesh

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

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
		cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
		return c.start(cfg)
	}
	a, b := mk("a"), mk("b")
	b.join(t, a)
	eventually(t, 5*time.Second, "a sees b", func() bool { return len(a.m.Members()) == 2 })
	old, _ := a.m.ListKeys()
	newKey, _ := identity.NewGossipKey()

	for _, n := range []*testNode{a, b} {
		if err := n.m.InstallKey(newKey); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 5*time.Second, "both nodes hold the new key", func() bool {
		keys, members := a.m.ListKeys()
		return members == 2 && len(keys) == 2 && keys[1].Key == newKey && keys[1].Nodes == 2 && keys[0].Primary
	})
	// b names the new key in its node meta by the fingerprint ListKeys shows.
	raw, _ := identity.ParseGossipKey(newKey)
	fp := identity.GossipKeyFingerprint(raw)
	if keys, _ := a.m.ListKeys(); keys[1].Fingerprint != fp {
		t.Errorf("ListKeys fingerprint of the new key = %s, want %s", keys[1].Fingerprint, fp)
	}
	a.m.mu.RLock()
	inMeta := slices.Contains(a.m.peers["b"].meta.keyFPs, fp)
	a.m.mu.RUnlock()
	if !inMeta {
		t.Errorf("b's node meta (as a holds it) does not carry fingerprint %s of the new key", fp)
	}
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
	onDisk, err := identity.LoadKeyring(a.m.cfg.KeyringPath)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := identity.ParseGossipKey(newKey)
	if len(onDisk) != 1 || !slices.Equal(onDisk[0], want) {
		t.Errorf("persisted keyring = %d keys, want the new key only", len(onDisk))
	}
	// The mesh still works on the new key: a change still propagates.
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "")
	eventually(t, 5*time.Second, "a resolves chat to b after rotation", func() bool { return a.resolvesTo("chat", "b") })
}
