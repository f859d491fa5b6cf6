package mesh

import (
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/identity"
)

func TestDigestRoundTrip(t *testing.T) {
	d := liveDigest{n: 1000, xor: nameHash("a") ^ nameHash("b")}
	got, from, err := decodeDigest(encodeDigest(d, "node-7"))
	if err != nil || got != d || from != "node-7" {
		t.Fatalf("decode(encode) = %v %q %v, want %v node-7", got, from, err, d)
	}
	for _, b := range [][]byte{nil, {msgDigest}, {msgDigest, 1, 2, 3}, {msgAdvert, 1, 0, 0, 0, 0, 0, 0, 0, 0}} {
		if _, _, err := decodeDigest(b); err == nil {
			t.Errorf("decodeDigest(%v) accepted", b)
		}
	}
	// The digest is of the set, not of the order names came in.
	if nameHash("a")^nameHash("b") != nameHash("b")^nameHash("a") || nameHash("a") == nameHash("b") {
		t.Error("nameHash")
	}
}

// TestAntiEntropyRepairsMissedJoin: a member that heard none of the gossip
// about a new node (deaf to packets while the new node's alive messages
// were retransmitted) learns of it through the membership digests and a
// push/pull, though memberlist's periodic push/pull is an hour away.
func TestAntiEntropyRepairsMissedJoin(t *testing.T) {
	c := newTestCluster(t)
	c.tweak = func(cfg *Config) {
		cfg.PushPullInterval = time.Hour
		// c's own probes fail while it is deaf: keep them rare.
		cfg.ProbeInterval, cfg.ProbeTimeout = 5*time.Second, time.Second
	}
	a, b := c.node("a"), c.node("b")
	var deaf *partitionable
	cfg := c.config("c")
	cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
	cfg.WrapTransport = func(nt memberlist.NodeAwareTransport) memberlist.NodeAwareTransport {
		deaf = newPartitionable(nt)
		return deaf
	}
	cn := c.start(cfg)
	b.join(t, a)
	cn.join(t, a)
	eventually(t, 5*time.Second, "a, b and c see each other", func() bool {
		return seesAll(a, "b", "c") && seesAll(b, "a", "c") && seesAll(cn, "a", "b")
	})

	deaf.deaf.Store(true)
	d := c.node("d")
	d.join(t, a)
	eventually(t, 5*time.Second, "a, b and d see each other", func() bool {
		return seesAll(a, "b", "d") && seesAll(b, "a", "d") && seesAll(d, "a", "b", "c")
	})
	// d's alive messages are retransmitted RetransmitMult x 1 times each:
	// wait until c has missed some and the gossip to c has gone quiet
	// (no packet dropped for 10 polls in a row), so what c learns of d
	// after it hears again is not a late retransmission.
	var last int64
	quiet := 0
	eventually(t, 30*time.Second, "the gossip c misses goes quiet", func() bool {
		n := deaf.dropped.Load()
		if n == last {
			quiet++
		} else {
			last, quiet = n, 0
		}
		return n > 0 && quiet >= 10
	})
	deaf.deaf.Store(false)
	eventually(t, 5*time.Second, "c learns of d", func() bool { return seesAll(cn, "d") })
	var pushPulls uint64
	for _, n := range []*testNode{a, b, cn, d} {
		pushPulls += n.m.GossipStats().AntiEntropyPushPulls
	}
	t.Logf("anti-entropy push/pulls: %d", pushPulls)
}

// starCluster starts the named nodes and x, all joining the first, and
// waits until everyone sees everyone.
func starCluster(t *testing.T, c *testCluster, names ...string) (others map[string]*testNode, x *testNode) {
	t.Helper()
	others = map[string]*testNode{}
	for _, name := range names {
		others[name] = c.node(name)
		if name != names[0] {
			others[name].join(t, others[names[0]])
		}
	}
	x = c.node("x")
	x.join(t, others[names[0]])
	eventually(t, 10*time.Second, "everyone sees everyone", func() bool {
		for _, n := range others {
			if !seesAll(n, append(names, "x")...) {
				return false
			}
		}
		return seesAll(x, names...)
	})
	return others, x
}

// falseDeath has every node of others declare x dead (forged deaths from a
// gossip key holder, standing in for probes that time out on a loaded
// host) until none lists it, then waits until all list it again: x
// learnt it was declared dead and refuted it.
func falseDeath(t *testing.T, others map[string]*testNode, x *testNode) {
	t.Helper()
	forgers := map[string]func(string){}
	for name, n := range others {
		forgers[name] = deathForger(t, n)
	}
	eventually(t, 5*time.Second, "every other member forgets x", func() bool {
		gone := 0
		for name, n := range others {
			if slices.Contains(memberNames(n.m), x.name) {
				forgers[name](x.name)
			} else {
				gone++
			}
		}
		return gone == len(others)
	})
	eventually(t, 10*time.Second, "every other member sees x again", func() bool {
		for _, n := range others {
			if !slices.Contains(memberNames(n.m), x.name) {
				return false
			}
		}
		return true
	})
}

// A node every other member holds dead, after deaths forged at different
// incarnations, may never hear the last of them (members that already
// hold it dead do not pass a dead message on). It still sends them its
// membership digest; the member that gets it push/pulls with it, not with
// a third member (which holds it dead too, or alive at an incarnation the
// death overrides), so it learns it was declared dead, refutes, and is a
// member everywhere again; memberlist's own push/pull is an hour away.
func TestDigestFromADeadSenderMakesItRefute(t *testing.T) {
	c := newTestCluster(t)
	c.tweak = func(cfg *Config) { cfg.PushPullInterval = time.Hour }
	others, x := starCluster(t, c, "a", "b", "c", "d", "e")
	for range 3 {
		falseDeath(t, others, x)
	}
}
