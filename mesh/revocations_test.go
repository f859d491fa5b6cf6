package mesh

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

// statement signs, with priv, that subject is revoked (or lifted) as of
// serial.
func statement(t *testing.T, priv ed25519.PrivateKey, subject string, revoked bool, serial uint64) *identity.Revocation {
	t.Helper()
	r, err := identity.IssueRevocation(priv, subject, revoked, serial, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// holds reports whether n holds a statement about subject with serial.
func holds(n *testNode, subject string, serial uint64) bool {
	r, ok := n.m.Revocation(subject)
	return ok && r.Serial == serial
}

// TestSignedRevocationHoldsEverywhere: a revocation signed by the authority
// and accepted on one node reaches every other by gossip alone, and a node
// that joins later gets it in the join's push/pull. Every node then
// refuses the subject: its adverts are forgotten, it is not admitted.
func TestSignedRevocationHoldsEverywhere(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 30 * time.Second
	nodes := cluster(t, c, "a", "b", "c", "d")
	a, d := nodes[0], nodes[3]
	d.serve(t, "chat", "m")
	for _, n := range nodes[:3] {
		eventually(t, 5*time.Second, n.name+" resolves chat to d", func() bool { return n.resolvesTo("chat", "d") })
	}

	r := statement(t, c.authority, "d", true, 10)
	if ok, err := a.m.AcceptRevocation(r, "admin"); !ok || err != nil {
		t.Fatalf("AcceptRevocation = %v, %v; want accepted", ok, err)
	}
	if a.m.IsAdmitted("d") || a.resolvesTo("chat", "d") {
		t.Fatal("a still admits d right after accepting its signed revocation")
	}
	start := time.Now()
	for _, n := range nodes[1:3] {
		eventually(t, 5*time.Second, n.name+" holds the revocation and refuses d", func() bool {
			return holds(n, "d", 10) && !n.m.IsAdmitted("d") && !n.resolvesTo("chat", "d")
		})
	}
	t.Logf("b and c refused d %v after a accepted the statement, by gossip alone", time.Since(start).Round(time.Millisecond))
	if !a.audit.membership(AuditRevocationAccepted, "d") || !nodes[1].audit.membership(AuditRevocationAccepted, "d") {
		t.Error("the accepted statement was not audited on a and b")
	}

	drainBroadcasts(t, nodes)
	e := c.node("e")
	e.join(t, nodes[2])
	if !holds(e, "d", 10) {
		t.Error("a node that joined after the revocation does not hold it: the join's push/pull did not carry it")
	}
	if e.m.IsAdmitted("d") {
		t.Error("the late joiner admits d")
	}
}

// TestUnsignedOrForgedRevocationCutsNobodyOut: a full-scope member's word
// that a node is revoked is worth nothing. A statement signed by its own
// node key, or by an authority nobody trusts, is refused (counted and
// audited) on every node; a run-time revocation stays on the node that
// made it.
func TestUnsignedOrForgedRevocationCutsNobodyOut(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b", "c")
	a, b, cn := nodes[0], nodes[1], nodes[2]

	_, stranger, _ := ed25519.GenerateKey(rand.Reader)
	for name, st := range map[string]*identity.Revocation{
		"signed by b's node key":      statement(t, b.m.NodeKey(), "c", true, 1<<62),
		"signed by another authority": statement(t, stranger, "c", true, 1<<62),
	} {
		send(t, b, a, encodeRevocationMsg(st))
		if _, err := a.m.AcceptRevocation(st, "admin"); !errors.Is(err, identity.ErrBadRevocation) {
			t.Errorf("%s: AcceptRevocation = %v, want ErrBadRevocation", name, err)
		}
	}
	eventually(t, 5*time.Second, "a refuses the gossiped forgeries", func() bool { return a.refusals(reasonRevocationSignature) >= 3 })
	if !a.audit.has(AuditRevocationRefused, reasonRevocationSignature) {
		t.Error("a refused forgery was not audited")
	}
	if err := b.m.Revoke("c"); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*testNode{a, cn} {
		if _, ok := n.m.Revocation("c"); ok {
			t.Errorf("%s holds a statement about c", n.name)
		}
	}
	if !a.m.IsAdmitted("c") || !cn.m.IsAdmitted("b") {
		t.Error("a forged or local revocation cut a node out elsewhere")
	}
}

// TestReplayedRevocationAfterUnrevokeChangesNothing: the authority revokes
// d, then lifts it with a later serial. The old revocation, replayed by
// gossip or over the admin path, is older than the lifting every node
// holds: d stays admitted. So it does on a node that restarts with the
// lifting loaded from its store.
func TestReplayedRevocationAfterUnrevokeChangesNothing(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b", "d")
	a, b := nodes[0], nodes[1]
	revoke, lift := statement(t, c.authority, "d", true, 1), statement(t, c.authority, "d", false, 2)
	if ok, err := a.m.AcceptRevocation(revoke, "admin"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	eventually(t, 5*time.Second, "b holds the revocation", func() bool { return holds(b, "d", 1) && !b.m.IsAdmitted("d") })
	if ok, err := a.m.AcceptRevocation(lift, "admin"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	eventually(t, 5*time.Second, "b holds the lifting and admits d again", func() bool { return holds(b, "d", 2) && b.m.IsAdmitted("d") })

	stale := b.refusals(reasonRevocationStale)
	send(t, a, b, encodeRevocationMsg(revoke))
	eventually(t, 5*time.Second, "b refuses the replay it was gossiped", func() bool { return b.refusals(reasonRevocationStale) > stale })
	if _, err := b.m.AcceptRevocation(revoke, "admin"); !errors.Is(err, ErrStaleRevocation) {
		t.Errorf("replayed revocation: AcceptRevocation = %v, want ErrStaleRevocation", err)
	}
	if !holds(b, "d", 2) || !b.m.IsAdmitted("d") {
		t.Error("a replayed older revocation took d out again")
	}

	// A restarted node loads what its store kept: the lifting, then the
	// replay arrives.
	cfg := c.config("b2")
	cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
	b2 := c.start(cfg)
	if err := b2.m.LoadRevocations([]*identity.Revocation{lift}); err != nil {
		t.Fatal(err)
	}
	if _, err := b2.m.AcceptRevocation(revoke, "gossip"); !errors.Is(err, ErrStaleRevocation) {
		t.Errorf("after a restart the replay = %v, want ErrStaleRevocation", err)
	}
	if got := b2.m.Revocations(); len(got) != 1 || got[0].Revoked {
		t.Errorf("after a restart and a replay b2 holds %v, want the lifting", got)
	}
}

// TestAuthorityChangeDropsItsStatements: statements held stop counting
// when no configured authority signed them any more.
func TestAuthorityChangeDropsItsStatements(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "d")
	a := nodes[0]
	if ok, err := a.m.AcceptRevocation(statement(t, c.authority, "d", true, 1), "admin"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	// d is trusted statically from now on, and the authority is gone.
	trust := TrustConfig{Nodes: []TrustedNode{{Name: "d", PublicKey: nodes[1].m.PublicKey()}}}
	if err := a.m.SetTrust(trust); err != nil {
		t.Fatal(err)
	}
	if len(a.m.Revocations()) != 0 || !a.m.IsAdmitted("d") {
		t.Errorf("after the authority was removed a holds %v and admits d: %v; want none held, admitted", a.m.Revocations(), a.m.IsAdmitted("d"))
	}
}

// TestMayChangeKeyring: who may change a node's keyring over QUIC, with
// the evidence of every refusal.
func TestMayChangeKeyring(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b", "c", "d")
	a, b, cn, d := nodes[0], nodes[1], nodes[2], nodes[3]
	kcfg := c.config("k")
	kcfg.Certificate = c.certFor(kcfg, identity.ScopeConsumer, time.Hour)
	k := c.start(kcfg)
	k.join(t, a)
	eventually(t, 5*time.Second, "a admits k", func() bool { return a.m.IsAdmitted("k") })

	if err := a.m.Revoke("c"); err != nil {
		t.Fatal(err)
	}
	if ok, err := a.m.AcceptRevocation(statement(t, c.authority, identity.EncodeNodeKey(d.m.PublicKey()), true, 1), "admin"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	_, otherKey, _ := ed25519.GenerateKey(rand.Reader)
	for _, tt := range []struct {
		name string
		node string
		key  ed25519.PublicKey
		want error // nil: may
		why  string
	}{
		{"full scope, trusted", "b", b.m.PublicKey(), nil, ""},
		{"revoked on this node", "c", cn.m.PublicKey(), ErrKeyringSenderRevoked, "revoked on this node"},
		{"revoked by the authority, by key", "d", d.m.PublicKey(), ErrKeyringSenderRevoked, "signed by authority"},
		{"consumer scope", "k", k.m.PublicKey(), ErrKeyringSenderScope, "scope consumer"},
		{"another key under b's name", "b", otherKey.Public().(ed25519.PublicKey), ErrKeyringSenderScope, "presented key"},
		{"never seen", "z", otherKey.Public().(ed25519.PublicKey), ErrKeyringSenderScope, "not vouched for"},
	} {
		err := a.m.MayChangeKeyring(tt.node, tt.key)
		if tt.want == nil {
			if err != nil {
				t.Errorf("%s: MayChangeKeyring = %v, want nil", tt.name, err)
			}
			continue
		}
		if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.why) {
			t.Errorf("%s: MayChangeKeyring = %v, want %v naming %q", tt.name, err, tt.want, tt.why)
		}
	}
}
