package mesh

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

// keyFPs lists the fingerprints of n's gossip keys.
func keyFPs(n *testNode) []identity.Fingerprint {
	var out []identity.Fingerprint
	for _, k := range n.m.keyring.GetKeys() {
		out = append(out, identity.GossipKeyFingerprint(k))
	}
	return out
}

// quicCluster is a test cluster whose nodes each get a QUIC socket on
// their own address (pcs, by node name) advertised in their meta.
func quicCluster(t *testing.T) (*testCluster, map[string]net.PacketConn) {
	c := newTestCluster(t)
	pcs := map[string]net.PacketConn{}
	c.tweak = func(cfg *Config) {
		pc, err := net.ListenPacket("udp", cfg.BindAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		pcs[cfg.NodeName] = pc
		cfg.QUICAddr = pc.LocalAddr().String()
	}
	return c, pcs
}

// TestRevocationRotatesTheGossipKey: a, b and c share the gossip key; c is
// revoked on a, and a rotates the key cluster-wide. The new key reaches b
// over QUIC and never c; the old key is gone everywhere else, so c's
// gossip (here: a forged death of b under the old key) is dropped and c
// can read no one's.
func TestRevocationRotatesTheGossipKey(t *testing.T) {
	c, pcs := quicCluster(t)
	tweak := c.tweak
	c.tweak = func(cfg *Config) {
		tweak(cfg)
		// Each node its own keyring file, as on separate hosts.
		b, err := os.ReadFile(c.keyring)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			t.Fatal(err)
		}
		cfg.KeyringPath = filepath.Join(cfg.StateDir, "keyring.json")
		if err := os.WriteFile(cfg.KeyringPath, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	nodes := cluster(t, c, "a", "b", "c")
	a, b, cn := nodes[0], nodes[1], nodes[2]
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "m")
	trs := map[string]*Transport{}
	for _, n := range nodes {
		tr := quicNode(t, n, pcs[n.name], false)
		trs[n.name] = tr
	}
	eventually(t, 10*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	oldKeys, err := identity.LoadKeyring(a.m.cfg.KeyringPath)
	if err != nil {
		t.Fatal(err)
	}
	oldFP := identity.GossipKeyFingerprint(oldKeys[0])

	revoked := time.Now()
	if err := a.m.Revoke("c"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := a.m.RotateGossipKey(ctx, trs["a"], "revoked c")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("revoked c; old key gone from every admitted node %v after the revocation (rotation took %v)",
		time.Since(revoked).Round(time.Millisecond), res.Took.Round(time.Millisecond))
	if len(res.Failed) != 0 || !slices.Equal(res.Peers, []string{"b"}) {
		t.Errorf("rotation reached %v, failed %v; want b only, no failure", res.Peers, res.Failed)
	}
	for _, n := range []*testNode{a, b} {
		if got := keyFPs(n); !slices.Equal(got, []identity.Fingerprint{res.Fingerprint}) {
			t.Errorf("%s holds %v, want only the new key %v", n.name, got, res.Fingerprint)
		}
		saved, err := identity.LoadKeyring(n.m.cfg.KeyringPath)
		if err != nil || len(saved) != 1 || identity.GossipKeyFingerprint(saved[0]) != res.Fingerprint {
			t.Errorf("%s's keyring file holds %d keys (%v), want the new one", n.name, len(saved), err)
		}
	}
	if got := keyFPs(cn); !slices.Equal(got, []identity.Fingerprint{oldFP}) {
		t.Errorf("revoked c holds %v, want only the old key", got)
	}

	// c, with the old key, forges b's death to a: dropped.
	attacker, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer attacker.Close()
	to, _ := net.ResolveUDPAddr("udp", a.m.GossipAddr())
	for i := range 20 {
		if _, err := attacker.WriteTo(deadPacket(t, oldKeys[0], "test", "b", "c", uint32(5000+i)), to); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if !a.resolvesTo("chat", "b") {
			t.Fatal("a dropped b after a death forged with the old key")
		}
	}
	// c reads nothing any more: it loses a and b.
	eventually(t, 20*time.Second, "c can no longer gossip with a and b", func() bool {
		return slices.Equal(memberNames(cn.m), []string{"c"})
	})
	// c losing a and b does not mean they lost c at the same moment:
	// their probes, under the new key, go unanswered until c is declared
	// dead (suspicion), however loaded the host.
	eventually(t, 30*time.Second, "a and b no longer list revoked c", func() bool {
		return slices.Equal(memberNames(a.m), []string{"a", "b"}) && slices.Equal(memberNames(b.m), []string{"a", "b"})
	})
}

// TestKeyringChangesOnlyFromFullScopePeers: a consumer-scope node cannot
// push a keyring change.
func TestKeyringChangesOnlyFromFullScopePeers(t *testing.T) {
	c, pcs := quicCluster(t)
	a := c.node("a")
	cfg := c.config("k")
	cfg.Certificate = c.certFor(cfg, identity.ScopeConsumer, time.Hour)
	k := c.start(cfg)
	k.join(t, a)
	eventually(t, 5*time.Second, "a admits k", func() bool { return a.m.IsAdmitted("k") })
	quicNode(t, a, pcs["a"], false)
	trk := quicNode(t, k, pcs["k"], false)
	key, _ := identity.NewGossipKey()
	err := trk.PushKeyring(context.Background(), "a", KeyringOp{Op: KeyringOpInstall, Key: key, Reason: "test", Rotation: "test"})
	if err == nil {
		t.Fatal("a took a keyring change from a consumer-scope node")
	}
	if len(a.m.keyring.GetKeys()) != 1 {
		t.Errorf("a holds %d keys, want 1", len(a.m.keyring.GetKeys()))
	}
}

// TestKeyringChangeNamesItsReasonAndRotation: a full-scope peer's change
// without a reason or a rotation is refused, and every change, applied or
// refused, reaches OnKeyring with the sender, the reason, the rotation
// and the key's fingerprint (never the key).
func TestKeyringChangeNamesItsReasonAndRotation(t *testing.T) {
	c, pcs := quicCluster(t)
	nodes := cluster(t, c, "a", "b")
	a, b := nodes[0], nodes[1]
	var mu sync.Mutex
	var events []KeyringEvent
	tra := runTransport(t, TransportConfig{Name: "a", Key: a.m.NodeKey(), PacketConn: pcs["a"], Peers: a.m, Keyring: a.m,
		OnKeyring: func(ev KeyringEvent) {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}})
	trb := quicNode(t, b, pcs["b"], false)
	key, _ := identity.NewGossipKey()
	raw, _ := identity.ParseGossipKey(key)
	fp := identity.GossipKeyFingerprint(raw).String()
	ctx := context.Background()
	for _, op := range []KeyringOp{
		{Op: KeyringOpInstall, Key: key, Rotation: fp},
		{Op: KeyringOpInstall, Key: key, Reason: "test"},
	} {
		if err := trb.PushKeyring(ctx, "a", op); err == nil {
			t.Errorf("a took %+v, which names no reason or no rotation", op)
		}
	}
	if len(keyFPs(a)) != 1 {
		t.Fatalf("a holds %d keys, want 1", len(keyFPs(a)))
	}
	if err := trb.PushKeyring(ctx, "a", KeyringOp{Op: KeyringOpInstall, Key: key, Reason: "test", Rotation: fp}); err != nil {
		t.Fatal(err)
	}
	if got := tra.Refusals()[refusedKeyring]; got != 2 {
		t.Errorf("a counted %d keyring refusals, want 2", got)
	}
	mu.Lock()
	defer mu.Unlock()
	// The second refusal, of the same sender and operation within 10s, is
	// counted but not told again.
	if len(events) != 2 {
		t.Fatalf("OnKeyring heard %d events, want 2: %+v", len(events), events)
	}
	if ev := events[0]; ev.Peer != "b" || ev.Refused == "" || !slices.Equal(ev.Fingerprints, []string{fp}) {
		t.Errorf("first refusal = %+v, want b refused, naming fingerprint %s", ev, fp)
	}
	if ev := events[1]; ev.Peer != "b" || ev.Refused != "" || ev.Failed != "" || ev.Reason != "test" || ev.Rotation != fp {
		t.Errorf("applied change = %+v, want b's, with its reason and rotation", ev)
	}
	for _, ev := range events {
		if strings.Contains(fmt.Sprint(ev), key) {
			t.Errorf("OnKeyring was given the key itself: %+v", ev)
		}
	}
}
