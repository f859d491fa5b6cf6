package mesh

import (
	"context"
	"testing"
	"time"
)

// TestUnrevokeTakesEffectAtOnce: a revoked peer's roles come back as soon
// as the revocation is lifted, not at its next re-advertisement (10s here)
// or push/pull (a minute here).
func TestUnrevokeTakesEffectAtOnce(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 30 * time.Second
	nodes := cluster(t, c, "a", "b")
	a, b := nodes[0], nodes[1]
	b.serve(t, "chat", "m")
	eventually(t, 5*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	if err := a.m.Revoke("b"); err != nil {
		t.Fatal(err)
	}
	if a.resolvesTo("chat", "b") {
		t.Fatal("a resolves chat to revoked b")
	}
	start := time.Now()
	if err := a.m.Unrevoke("b"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 3*time.Second, "a resolves chat to b again", func() bool { return a.resolvesTo("chat", "b") })
	t.Logf("chat back %v after unrevoke", time.Since(start).Round(time.Millisecond))
}

// TestRefusedNodesAreListed: a node with no admission tries to join; the
// node it contacts lists it with the reason, the key it presented and when
// it was seen.
func TestRefusedNodesAreListed(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	x := c.start(c.config("x")) // no certificate: not trusted
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, _ = x.m.JoinAddrs(ctx, []string{a.m.GossipAddr()})
	eventually(t, 5*time.Second, "a lists x as refused", func() bool {
		for _, r := range a.m.RefusedNodes() {
			if r.Name == "x" {
				return r.Why == whyNotTrusted && r.PublicKey.Equal(x.m.PublicKey()) && !r.LastSeen.IsZero()
			}
		}
		return false
	})
	for _, p := range a.m.Members() {
		if p.Name == "x" {
			t.Errorf("x is a member of a")
		}
	}
}
