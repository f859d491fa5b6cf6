package agent

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/mesh"
)

func primaryFP(m *mesh.Mesh) (string, int) {
	keys, _ := m.ListKeys()
	return keys[0].Fingerprint.String(), len(keys)
}

// TestRevokeRotatesGossipKeyClusterWide: `infermesh revoke c` on a rotates
// the gossip key on a and b over QUIC, never on c. Once b revokes c too
// (and rotates again), c can reach no one by gossip or QUIC and loses the
// mesh; a and b stay together and a keeps serving chat from b.
func TestRevokeRotatesGossipKeyClusterWide(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	a, b, _ := tm.startChatPair()
	c := tm.start("c", map[string]roleSpec{"x": {}}, false)
	waitFor(t, "the mesh forms and a serves chat from b", func() bool {
		return slices.Equal(members(c.agent.Mesh()), []string{"a", "b", "c"}) && a.resolvesTo("chat", "b") && chatOK(t, a)
	})
	oldFP, _ := primaryFP(a.agent.Mesh())

	ac := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer ac.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	start := time.Now()
	res, err := ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "c", On: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("revoke c answered after %v: %s", time.Since(start).Round(time.Millisecond), res.Note)
	if !strings.Contains(res.Note, "rotated") || strings.Contains(res.Note, "not reached") {
		t.Errorf("revoke note %q, want a rotation that reached every admitted peer", res.Note)
	}
	newFP, n := primaryFP(a.agent.Mesh())
	if newFP == oldFP || n != 1 {
		t.Fatalf("a's keyring: primary %s of %d keys, want one new key", newFP, n)
	}
	if fp, n := primaryFP(b.agent.Mesh()); fp != newFP || n != 1 {
		t.Errorf("b's keyring: primary %s of %d keys, want only %s", fp, n, newFP)
	}
	if fp, _ := primaryFP(c.agent.Mesh()); fp != oldFP {
		t.Errorf("revoked c's primary key is %s, want the old %s", fp, oldFP)
	}
	bc := admin.NewClient(b.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer bc.Close()
	if res, err := bc.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "c", On: true}); err != nil || !strings.Contains(res.Note, "rotated") {
		t.Fatalf("revoke c on b: %+v, %v", res, err)
	}
	if fa, _ := primaryFP(a.agent.Mesh()); fa == newFP {
		t.Errorf("b's rotation did not reach a")
	}
	waitFor(t, "c can no longer read the mesh's gossip", func() bool {
		return slices.Equal(members(c.agent.Mesh()), []string{"c"})
	})
	t.Logf("c lost the mesh %v after the revocation", time.Since(start).Round(time.Millisecond))
	// c and a each learn the other is gone by their own failure detection
	// (c can read no gossip, a's probes of c go unanswered), so c may lose
	// the mesh before a has declared it dead.
	waitFor(t, "a and b forget c", func() bool {
		return slices.Equal(members(a.agent.Mesh()), []string{"a", "b"}) && slices.Equal(members(b.agent.Mesh()), []string{"a", "b"})
	})
	t.Logf("a and b forgot c %v after the revocation", time.Since(start).Round(time.Millisecond))
	if !chatOK(t, a) {
		t.Errorf("after the rotation a does not serve chat from b")
	}
	if !a.audited(AuditKeyRotated, "revoked c") || !b.audited(AuditKeyringByPeer, "") {
		t.Errorf("the rotation was not audited on a and b")
	}
}
