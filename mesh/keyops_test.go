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

// ownKeyringNode starts an admitted node with a keyring file of its own,
// a copy of the cluster's: keyring changes are persisted.
func ownKeyringNode(t *testing.T, c *testCluster, name string) *testNode {
	t.Helper()
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

func TestKeyringRotation(t *testing.T) {
	c := newTestCluster(t)
	a, b := ownKeyringNode(t, c, "a"), ownKeyringNode(t, c, "b")
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

// TestKeyRemovalLeavesReadersAlone: memberlist decrypts every packet with
// the key slice GetKeys returned, without a lock, and its RemoveKey shifts
// the keys after the one removed in place. RemoveKey and RetainKeys of a
// key in the middle of the keyring leave a slice handed out before
// untouched (so a packet being decrypted meanwhile sees the keyring as it
// was), and keep the other keys, in order, on disk too.
func TestKeyRemovalLeavesReadersAlone(t *testing.T) {
	a := ownKeyringNode(t, newTestCluster(t), "a")
	var extra []string
	for range 4 {
		k, _ := identity.NewGossipKey()
		if err := a.m.InstallKey(k); err != nil {
			t.Fatal(err)
		}
		extra = append(extra, k)
	}
	fps := func(keys [][]byte) []identity.Fingerprint {
		var out []identity.Fingerprint
		for _, k := range keys {
			out = append(out, identity.GossipKeyFingerprint(k))
		}
		return out
	}
	check := func(what string, change func() error, want []identity.Fingerprint) {
		t.Helper()
		handedOut := a.m.keyring.GetKeys()
		before := fps(slices.Clone(handedOut))
		if err := change(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := fps(handedOut); !slices.Equal(got, before) {
			t.Errorf("%s rewrote a key slice handed out before: %v, was %v", what, got, before)
		}
		if got := fps(a.m.keyring.GetKeys()); !slices.Equal(got, want) {
			t.Errorf("after %s the keyring is %v, want %v", what, got, want)
		}
		onDisk, err := identity.LoadKeyring(a.m.cfg.KeyringPath)
		if err != nil || !slices.Equal(fps(onDisk), want) {
			t.Errorf("after %s the keyring file holds %v (%v), want %v", what, fps(onDisk), err, want)
		}
	}
	all := fps(a.m.keyring.GetKeys()) // primary, extra[0..3]
	check("RemoveKey of the second key", func() error { return a.m.RemoveKey(extra[0]) }, []identity.Fingerprint{all[0], all[2], all[3], all[4]})
	primary := identity.EncodeGossipKey(a.m.keyring.GetPrimaryKey())
	check("RetainKeys of the primary and the last key", func() error { return a.m.RetainKeys([]string{primary, extra[3]}) },
		[]identity.Fingerprint{all[0], all[4]})
	if err := a.m.RetainKeys([]string{extra[3]}); !errors.Is(err, ErrPrimaryKey) {
		t.Errorf("RetainKeys without the primary = %v, want ErrPrimaryKey", err)
	}
}
