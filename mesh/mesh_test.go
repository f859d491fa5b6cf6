package mesh

import (
	"context"
	"crypto/ed25519"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/identity"
)

// cluster starts named admitted nodes, all joined to the first, each
// allowing every other node to serve "chat".
func cluster(t *testing.T, c *testCluster, names ...string) []*testNode {
	t.Helper()
	nodes := make([]*testNode, len(names))
	for i, name := range names {
		nodes[i] = c.node(name)
		for _, other := range names {
			if other != name {
				nodes[i].tab.AllowRemoteNode("chat", other, true)
			}
		}
	}
	for _, n := range nodes[1:] {
		n.join(t, nodes[0])
	}
	for _, n := range nodes {
		eventually(t, 5*time.Second, n.name+" sees every node", func() bool { return len(n.m.Members()) == len(nodes) })
	}
	return nodes
}

// drainBroadcasts waits until no node has a broadcast queued: what a node
// joining after learns, it learns from the join's push/pull.
func drainBroadcasts(t *testing.T, nodes []*testNode) {
	t.Helper()
	eventually(t, 5*time.Second, "broadcast queues drain", func() bool {
		for _, n := range nodes {
			if n.m.bcast.NumQueued() != 0 {
				return false
			}
		}
		return true
	})
}

func TestAdvertsPropagateAndLateJoinerConverges(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 30 * time.Second // re-advertising every 10s: convergence below comes from broadcast and push/pull
	nodes := cluster(t, c, "a", "b", "c", "d")
	a := nodes[0]
	a.serve(t, "chat", "llama")
	for _, n := range nodes[1:] {
		eventually(t, 5*time.Second, n.name+" resolves chat to a", func() bool { return n.resolvesTo("chat", "a") })
	}
	if got := nodes[1].tab.Resolve("chat")[0].Model; got != "llama" {
		t.Errorf("b resolves chat with model %q, want llama", got)
	}
	// Let a's broadcast finish so the late joiner can only learn the advert
	// through the join's push/pull.
	drainBroadcasts(t, nodes)
	e := c.node("e")
	e.tab.AllowRemoteNode("chat", "a", true)
	e.join(t, nodes[3]) // any member will do: d relays a's advert in its state
	eventually(t, 2*time.Second, "late joiner e resolves chat to a", func() bool { return e.resolvesTo("chat", "a") })

	// A withdrawn role stops resolving everywhere well within the TTL.
	a.tab.DeregisterLocal("chat")
	for _, n := range append(nodes[1:], e) {
		eventually(t, 5*time.Second, n.name+" forgets withdrawn chat", func() bool { return !n.resolvesTo("chat", "a") })
	}
}

// send delivers a raw gossip message from one node to another. The target
// is a Node of our own making: memberlist.Members' nodes are shared with its
// state goroutines, which rewrite them as gossip arrives (a data race).
func send(t *testing.T, from, to *testNode, msg []byte) {
	t.Helper()
	if !slices.Contains(memberNames(from.m), to.name) {
		t.Fatalf("%s does not know %s", from.name, to.name)
	}
	host, port, err := net.SplitHostPort(to.m.GossipAddr())
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	target := &memberlist.Node{Name: to.name, Addr: net.ParseIP(host), Port: uint16(p)}
	if err := from.m.ml.SendReliable(target, msg); err != nil {
		t.Fatal(err)
	}
}

func TestForgedAndReplayedAdvertsAreRefused(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 30 * time.Second
	nodes := cluster(t, c, "a", "b", "c")
	a, b, cn := nodes[0], nodes[1], nodes[2]

	// b signs an advert claiming to be c, and relays it to a.
	forged, err := encodeAdvert(advertBody{Cluster: "test", Origin: "c", Role: "chat", Seq: uint64(time.Now().UnixNano()), API: "openai"}, b.m.priv)
	if err != nil {
		t.Fatal(err)
	}
	send(t, b, a, forged)
	eventually(t, 2*time.Second, "a refuses the forged advert", func() bool { return a.refusals(reasonBadSignature) >= 1 })
	if a.resolvesTo("chat", "c") {
		t.Fatal("a resolves chat to c from an advert b signed")
	}
	if !a.audit.has(AuditAdvertRefused, reasonBadSignature) {
		t.Error("bad signature not audited")
	}

	// c really serves chat; capture its advert as a holds it.
	cn.serve(t, "chat", "m1")
	eventually(t, 5*time.Second, "a resolves chat to c", func() bool { return a.resolvesTo("chat", "c") })
	old := heldAdvert(a, "c", "chat")
	// A change makes c advertise a newer sequence number.
	cn.serve(t, "chat", "m2")
	eventually(t, 5*time.Second, "a hears c's new advert", func() bool {
		r := a.tab.Resolve("chat")
		return len(r) == 1 && r[0].Model == "m2"
	})
	received := receivedAt(t, a, "c", "chat")
	stale := a.refusals(reasonStale)
	send(t, b, a, old.msg) // b replays c's old advert
	eventually(t, 2*time.Second, "a refuses the replay", func() bool { return a.refusals(reasonStale) > stale })
	if r := a.tab.Resolve("chat"); len(r) != 1 || r[0].Model != "m2" {
		t.Fatalf("after replay a resolves %+v, want c with model m2", r)
	}
	if got := receivedAt(t, a, "c", "chat"); !got.Equal(received) {
		t.Errorf("replay refreshed the receipt time: %v, want %v", got, received)
	}
	// The same (current) advert again, as gossip repeats it, refreshes
	// nothing either and is no refusal.
	// It is handed to a's gossip delegate as memberlist hands a packet's
	// message over, so the check below follows its handling.
	cur := heldAdvert(a, "c", "chat")
	(*delegate)(a.m).NotifyMsg(cur.msg)
	if got := receivedAt(t, a, "c", "chat"); !got.Equal(received) {
		t.Errorf("a duplicate refreshed the receipt time: %v, want %v", got, received)
	}
}

func heldAdvert(n *testNode, origin, role string) advertRecord {
	n.m.advMu.Lock()
	defer n.m.advMu.Unlock()
	r := n.m.adverts[advertKey{origin, role}]
	if r == nil {
		return advertRecord{}
	}
	return *r
}

func receivedAt(t *testing.T, n *testNode, origin, role string) time.Time {
	t.Helper()
	for _, r := range n.tab.Snapshot().Remotes {
		if r.Node == origin && r.Role == role {
			return r.ReceivedAt
		}
	}
	t.Fatalf("%s holds no advert of %s from %s", n.name, role, origin)
	return time.Time{}
}

func TestUntrustedNodesAreRefused(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b")
	a := nodes[0]

	// x has the gossip key but no certificate and is on no static list.
	x := c.start(c.config("x"))
	x.serve(t, "chat", "")
	a.tab.AllowRemoteNode("chat", "x", true)
	_, _ = x.m.JoinAddrs(context.Background(), []string{a.m.GossipAddr()})
	eventually(t, 2*time.Second, "a refuses x", func() bool { return a.refusals(reasonUnadmitted) >= 1 })
	if slices.Contains(memberNames(a.m), "x") {
		t.Errorf("a lists unadmitted x as a member: %v", memberNames(a.m))
	}
	if a.IsAdmittedForTest("x") || a.resolvesTo("chat", "x") {
		t.Error("a admits or resolves unadmitted x")
	}
	if !a.audit.has(AuditNodeRefused, reasonUnadmitted) {
		t.Error("unadmitted node not audited")
	}

	// A consumer-scope node is a member, but its adverts are not heard.
	ccfg := c.config("consumer")
	ccfg.Certificate = c.certFor(ccfg, identity.ScopeConsumer, time.Hour)
	cons := c.start(ccfg)
	cons.serve(t, "chat", "")
	a.tab.AllowRemoteNode("chat", "consumer", true)
	cons.join(t, a)
	eventually(t, 2*time.Second, "a admits consumer", func() bool { return a.m.IsAdmitted("consumer") })
	// Its advertiser has passed over its roles since it served chat.
	rounds := cons.m.GossipStats().AdvertRounds
	eventually(t, 2*time.Second, "consumer's advertiser runs", func() bool { return cons.m.GossipStats().AdvertRounds >= rounds+2 })
	if cons.m.bcast.NumQueued() != 0 || heldAdvert(a, "consumer", "chat").seq != 0 {
		t.Error("a consumer-scope node advertised a role")
	}
	// Were it to advertise anyway, nobody would hear it.
	if _, err := cons.m.publish(advertBody{Role: "chat", API: "openai"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 2*time.Second, "a refuses consumer's advert", func() bool { return a.refusals(reasonNotFullScope) >= 1 })
	if a.resolvesTo("chat", "consumer") {
		t.Error("a resolves chat to a consumer-scope node")
	}
	if !a.m.IsAdmitted("consumer") || a.m.MayServe("consumer") {
		t.Errorf("consumer: IsAdmitted=%v MayServe=%v, want true, false", a.m.IsAdmitted("consumer"), a.m.MayServe("consumer"))
	}

	// Another cluster name (memberlist label) cannot join at all.
	ocfg := c.config("other")
	ocfg.Cluster = "elsewhere"
	ocfg.Certificate = c.certFor(ocfg, identity.ScopeFull, time.Hour)
	other := c.start(ocfg)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if n, err := other.m.JoinAddrs(ctx, []string{a.m.GossipAddr()}); err == nil {
		t.Errorf("join from another cluster: %d contacts, nil error; want an error", n)
	}
	// Nor can a node with another gossip key.
	kcfg := c.config("otherkey")
	kcfg.KeyringPath = filepath.Join(c.root, "other-keyring.json")
	if _, err := identity.WriteNewKeyring(kcfg.KeyringPath); err != nil {
		t.Fatal(err)
	}
	kcfg.Certificate = c.certFor(kcfg, identity.ScopeFull, time.Hour)
	otherKey := c.start(kcfg)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel2()
	if n, err := otherKey.m.JoinAddrs(ctx2, []string{a.m.GossipAddr()}); err == nil {
		t.Errorf("join with another gossip key: %d contacts, nil error; want an error", n)
	}
	if slices.Contains(memberNames(a.m), "other") || slices.Contains(memberNames(a.m), "otherkey") {
		t.Errorf("a lists foreign nodes: %v", memberNames(a.m))
	}
}

// IsAdmittedForTest is IsAdmitted on the node's mesh.
func (n *testNode) IsAdmittedForTest(node string) bool { return n.m.IsAdmitted(node) }

func TestMergeDelegateRefusesOtherCluster(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	_, priv, _ := ed25519.GenerateKey(nil)
	meta, err := (&nodeMeta{cluster: "elsewhere", key: priv.Public().(ed25519.PublicKey)}).marshal("z", priv)
	if err != nil {
		t.Fatal(err)
	}
	err = (*mergeDelegate)(a.m).NotifyMerge([]*memberlist.Node{{Name: "z", Meta: meta, State: memberlist.StateAlive}})
	if err == nil || !strings.Contains(err.Error(), reasonWrongCluster) {
		t.Fatalf("NotifyMerge(other cluster) = %v, want a %s error", err, reasonWrongCluster)
	}
	if got := a.refusals(reasonWrongCluster); got != 1 {
		t.Errorf("wrong_cluster refusals = %d, want 1", got)
	}
	// A forged meta (signed by another key than it carries) is refused too.
	_, other, _ := ed25519.GenerateKey(nil)
	bad, _ := (&nodeMeta{cluster: "test", key: priv.Public().(ed25519.PublicKey)}).marshal("z", other)
	if err := (*aliveDelegate)(a.m).NotifyAlive(&memberlist.Node{Name: "z", Meta: bad}); err == nil {
		t.Error("NotifyAlive accepted meta with a bad self-signature")
	}
}

func TestRevocationAndExpiryStopResolutionAtOnce(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 30 * time.Second
	nodes := cluster(t, c, "a", "b")
	a, b := nodes[0], nodes[1]
	b.serve(t, "chat", "")
	eventually(t, 5*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })

	tests := []struct {
		name    string
		revoke  func() error
		restore func() error
	}{
		{"by name", func() error { return a.m.Revoke("b") }, func() error { return a.m.Unrevoke("b") }},
		{"by key", func() error { return a.m.Revoke(identity.EncodeNodeKey(b.m.PublicKey())) }, func() error { return a.m.Unrevoke(identity.EncodeNodeKey(b.m.PublicKey())) }},
		{"certificate expiry", func() error { a.clock.Advance(2 * time.Hour); return nil }, func() error { a.clock.Advance(-2 * time.Hour); return nil }},
		{"trust reload", func() error { return a.m.SetTrust(TrustConfig{}) }, func() error { return a.m.SetTrust(c.config("a").Trust) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.revoke(); err != nil {
				t.Fatal(err)
			}
			// At once: no waiting.
			if got := a.remotes("chat"); len(got) != 0 {
				t.Fatalf("right after revocation a resolves chat to %v, want nothing", got)
			}
			if _, ok := a.m.PeerAddr("b"); ok {
				t.Error("PeerAddr of a revoked node is available")
			}
			if err := tt.restore(); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "a resolves chat to b again after its next advert", func() bool {
				// The entry was removed from placement: only a new advert
				// (b's change or refresh) brings it back.
				b.tab.SetLocalLoad("chat", uint32(time.Now().UnixNano()%1000))
				return a.resolvesTo("chat", "b")
			})
		})
	}
	if err := a.m.SetTrust(TrustConfig{Revoked: []string{"b"}}); err != nil {
		t.Fatal(err)
	}
	if err := a.m.Unrevoke("b"); !errors.Is(err, ErrRevokedByConfig) {
		t.Errorf("Unrevoke of a configured revocation = %v, want ErrRevokedByConfig", err)
	}
}

func TestTTLExpiryWithoutLeaving(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 600 * time.Millisecond
	nodes := cluster(t, c, "a")
	a := nodes[0]
	// b never re-advertises: it has no sink, and we publish one advert by hand.
	bcfg := c.config("b")
	bcfg.Certificate = c.certFor(bcfg, identity.ScopeFull, time.Hour)
	bcfg.Sink = noSink{}
	b := c.start(bcfg)
	a.tab.AllowRemoteNode("chat", "b", true)
	b.join(t, a)
	eventually(t, 2*time.Second, "a sees b", func() bool { return a.m.IsAdmitted("b") })
	if _, err := b.m.publish(advertBody{Role: "chat", API: "openai"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 2*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	eventually(t, 3*time.Second, "b's advert expires", func() bool { return !a.resolvesTo("chat", "b") })
	if !a.m.IsAdmitted("b") {
		t.Error("b should still be a member; only its advert expired")
	}
}

func TestLeaveAndDeathForgetAtOnce(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = time.Minute // only leave/death detection can make these stop resolving
	nodes := cluster(t, c, "a", "b", "c")
	a, b, cn := nodes[0], nodes[1], nodes[2]
	b.serve(t, "chat", "")
	cn.serve(t, "chat", "")
	eventually(t, 5*time.Second, "a resolves chat to b and c", func() bool {
		return a.resolvesTo("chat", "b") && a.resolvesTo("chat", "c")
	})

	if err := b.m.Leave(time.Second); err != nil {
		t.Fatal(err)
	}
	b.m.Close()
	eventually(t, 2*time.Second, "a forgets b after it left", func() bool { return !a.resolvesTo("chat", "b") })
	if !a.audit.membership(AuditPeerJoined, "b") {
		t.Error("b's join was not audited on a")
	}
	eventually(t, time.Second, "a audits b's leave", func() bool { return a.audit.membership(AuditPeerGone, "b") })

	cn.m.Close() // dies without a word
	eventually(t, 5*time.Second, "a forgets c once declared dead", func() bool { return !a.resolvesTo("chat", "c") })
	if a.m.IsAdmitted("c") {
		t.Error("a still admits dead c")
	}
	eventually(t, time.Second, "a audits c's death", func() bool { return a.audit.membership(AuditPeerGone, "c") })
}

// TestTrustOutlivesMembership: a peer declared dead is no longer a live
// member (nothing routes new requests to it), but it is still trusted, so a
// working QUIC connection to it is not cut by a false suspicion; revocation
// and a changed key end that trust.
func TestTrustOutlivesMembership(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b")
	a, b := nodes[0], nodes[1]
	key := b.m.PublicKey()
	if !a.m.TrustsKey("b", key) {
		t.Fatal("a does not trust live b")
	}
	other, _, _ := ed25519.GenerateKey(nil)
	if a.m.TrustsKey("b", other) {
		t.Error("a trusts b under another key")
	}
	b.m.Close() // dies without a word
	eventually(t, 5*time.Second, "a declares b dead", func() bool { return !a.m.IsAdmitted("b") })
	if _, ok := a.m.PeerKey("b"); ok {
		t.Error("PeerKey answers for a dead member (new connections would dial it)")
	}
	if !a.m.TrustsKey("b", key) {
		t.Error("a stopped trusting b's key because b left membership")
	}
	if err := a.m.Revoke("b"); err != nil {
		t.Fatal(err)
	}
	if a.m.TrustsKey("b", key) {
		t.Error("a still trusts revoked b")
	}
	if a.m.TrustsKey("nobody", key) {
		t.Error("a trusts a node it never saw")
	}
}

func TestDuplicateNameAndKeyAreRefused(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b")
	a := nodes[0]

	t.Run("same name, other key", func(t *testing.T) {
		cfg := c.config("b")
		cfg.StateDir = filepath.Join(c.root, "b-impostor")
		cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
		dup := c.start(cfg)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := dup.m.JoinAddrs(ctx, []string{a.m.GossipAddr()})
		if !errors.Is(err, ErrJoinRefused) || !strings.Contains(err.Error(), reasonNameConflict) {
			t.Fatalf("join with a taken name = %v, want ErrJoinRefused with %s", err, reasonNameConflict)
		}
		eventually(t, time.Second, "a counts the name conflict", func() bool { return a.refusals(reasonNameConflict) >= 1 })
	})
	t.Run("same key, other name (copied state dir)", func(t *testing.T) {
		cfg := c.config("b2")
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(filepath.Join(c.root, "b", identity.NodeKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(cfg.StateDir, identity.NodeKeyFile), data, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
		dup := c.start(cfg)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = dup.m.JoinAddrs(ctx, []string{a.m.GossipAddr()})
		if !errors.Is(err, ErrJoinRefused) || !strings.Contains(err.Error(), reasonKeyConflict) {
			t.Fatalf("join with a taken key = %v, want ErrJoinRefused with %s", err, reasonKeyConflict)
		}
		eventually(t, time.Second, "a counts the key conflict", func() bool { return a.refusals(reasonKeyConflict) >= 1 })
	})
	if got := memberNames(a.m); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("a's members = %v, want [a b]", got)
	}
}

func TestPeerAddrAndKey(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b")
	a, b := nodes[0], nodes[1]
	addr, ok := a.m.PeerAddr("b")
	if want := b.m.cfg.QUICAddr; !ok || addr != want {
		t.Errorf("PeerAddr(b) = %q, %v; want %q, true", addr, ok, want)
	}
	key, ok := a.m.PeerKey("b")
	if !ok || !key.Equal(b.m.PublicKey()) {
		t.Errorf("PeerKey(b) = %v, %v; want b's key", key, ok)
	}
	if _, ok := a.m.PeerAddr("nobody"); ok {
		t.Error("PeerAddr of an unknown node is available")
	}
}

func TestSingleNodeMeshAndEmptyJoin(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	n, err := a.m.Join(context.Background())
	if n != 0 || err != nil {
		t.Errorf("Join with no addresses = %d, %v; want 0, nil", n, err)
	}
	if err := a.m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.m.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
}

func TestJoinRetriesUntilContextEnds(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := a.m.JoinAddrs(ctx, []string{"127.0.0.1:1"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("join of a dead address = %v, want context.DeadlineExceeded", err)
	}
	if time.Since(start) < 250*time.Millisecond {
		t.Error("join gave up before its context ended")
	}
}

// TestMembersCertExpiry: Members reports when each node's admission
// certificate expires, this node's and the peers' as they gossip them.
func TestMembersCertExpiry(t *testing.T) {
	c := newTestCluster(t)
	nodes := cluster(t, c, "a", "b")
	want := map[string]time.Time{}
	for _, n := range nodes {
		cert, err := identity.ParseCertificate(n.m.cfg.Certificate)
		if err != nil {
			t.Fatal(err)
		}
		want[n.name] = cert.Expires
	}
	got := map[string]time.Time{}
	for _, p := range nodes[0].m.Members() {
		got[p.Name] = p.CertExpires
	}
	if len(got) != 2 || !got["a"].Equal(want["a"]) || !got["b"].Equal(want["b"]) {
		t.Errorf("certificate expiries %v, want %v", got, want)
	}
}
