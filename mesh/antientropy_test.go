package mesh

import (
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
