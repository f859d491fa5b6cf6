package mesh

import (
	"testing"
	"time"
)

// After a death gossip alone believed (no QUIC confirmer here), the peer
// refutes it and is seen alive again: its roles are back at once, from a
// push/pull with it, not at its next refresh (AdvertTTL/3, a minute here,
// longer than any wait below).
func TestPeerBackAliveIsReadvertisedAtOnce(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 3 * time.Minute
	a, b := c.node("a"), c.node("b")
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "m")
	b.join(t, a)
	eventually(t, 10*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	// The adverts' broadcasts die out first: a retransmission of one
	// would bring chat back by itself.
	eventually(t, 10*time.Second, "no advert broadcast queued", func() bool {
		return a.m.bcast.NumQueued() == 0 && b.m.bcast.NumQueued() == 0
	})

	forgeDeath := deathForger(t, a)
	eventually(t, 5*time.Second, "a forgets b after a forged death", func() bool {
		forgeDeath("b")
		time.Sleep(20 * time.Millisecond)
		return !a.resolvesTo("chat", "b")
	})
	start := time.Now()
	eventually(t, 5*time.Second, "a resolves chat to b again once b refuted its death", func() bool { return a.resolvesTo("chat", "b") })
	back := time.Since(start)
	t.Logf("chat back on a %v after the last forged death", back)

	if back >= c.ttl/3 {
		t.Errorf("chat came back after %v: the refresh, not the peer being back alive", back)
	}
}

// An advert that arrives before its origin is a member is held, and
// verified and ingested once the origin is admitted: not refused.
func TestEarlyAdvertIsHeldUntilItsOriginIsAdmitted(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 3 * time.Minute
	a, b := c.node("a"), c.node("b")
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "m")
	msg := ownAdvert(t, b, "chat")
	a.m.handleAdvert(msg, false) // b is not a member of a's mesh yet
	if n := a.refusals(reasonUnknownOrigin); n != 0 {
		t.Fatalf("an early advert was refused as unknown_origin (%d) instead of held", n)
	}
	if held := a.m.early.take("x"); held != nil {
		t.Fatalf("held adverts for a node that sent none: %d", len(held))
	}
	a.m.early.mu.Lock()
	n := a.m.early.n
	a.m.early.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d adverts held, want 1", n)
	}
	// b joins; whether the held advert or the join's push/pull brings chat,
	// the held one is taken and none is refused.
	b.join(t, a)
	eventually(t, 10*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	eventually(t, 5*time.Second, "the held advert is taken", func() bool {
		a.m.early.mu.Lock()
		defer a.m.early.mu.Unlock()
		return a.m.early.n == 0
	})
	if n := a.refusals(reasonUnknownOrigin); n != 0 {
		t.Errorf("%d unknown_origin refusals, want 0", n)
	}
}

// Early adverts are held a bounded time and in bounded number: one whose
// origin never comes is refused as unknown_origin after EarlyAdvertHold,
// and beyond the per-origin bound they are refused at once.
func TestEarlyAdvertsAreBounded(t *testing.T) {
	c := newTestCluster(t)
	a, z := c.node("a"), c.node("z")
	z.serve(t, "chat", "m")
	msg := ownAdvert(t, z, "chat")
	for range earlyMaxPerOrigin + 1 {
		a.m.handleAdvert(msg, false)
	}
	if n := a.refusals(reasonUnknownOrigin); n != 1 {
		t.Fatalf("%d unknown_origin refusals after %d early adverts of one origin, want 1 (the one over the bound)", n, earlyMaxPerOrigin+1)
	}
	start := time.Now()
	eventually(t, 2*EarlyAdvertHold, "the held adverts expire", func() bool {
		return a.refusals(reasonUnknownOrigin) == earlyMaxPerOrigin+1
	})
	if d := time.Since(start); d < EarlyAdvertHold/2 {
		t.Errorf("held adverts refused after %v, want about %v", d, EarlyAdvertHold)
	}
	if !a.audit.has(auditAdvertRefused, reasonUnknownOrigin) {
		t.Errorf("the expired adverts were not audited")
	}
}

// ownAdvert waits for n to advertise role and returns a copy of the
// signed message.
func ownAdvert(t *testing.T, n *testNode, role string) []byte {
	t.Helper()
	var msg []byte
	eventually(t, 5*time.Second, n.name+" advertises "+role, func() bool {
		n.m.advMu.Lock()
		defer n.m.advMu.Unlock()
		if r := n.m.adverts[advertKey{n.name, role}]; r != nil {
			msg = append([]byte(nil), r.msg...)
		}
		return msg != nil
	})
	return msg
}

// A peer falsely declared dead by every other member at once (the forged
// deaths stand in for probes timing out on a loaded host) comes back on
// all of them. Members that forgot none of its adverts (it serves nothing)
// start no push/pull with it: before, each of them did, all at the same
// moment, and on a loaded host that herd timed the peer's probes out
// again. Members that forgot its adverts do, and get them back.
func TestPeerBackHerd(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 3 * time.Minute
	others, x := starCluster(t, c, "a", "b", "c", "d", "e")
	pushPulls := func() (sum uint64) {
		for _, n := range others {
			sum += n.m.stats.backPushPulls.Load()
		}
		return sum
	}

	falseDeath(t, others, x)
	if n := pushPulls(); n != 0 {
		t.Errorf("%d push/pulls with x back alive, serving nothing; want 0", n)
	}

	allResolve := serveChatAtX(t, others, x)
	eventually(t, 10*time.Second, "no advert broadcast queued", func() bool {
		for _, n := range others {
			if n.m.bcast.NumQueued() != 0 {
				return false
			}
		}
		return x.m.bcast.NumQueued() == 0
	})
	falseDeath(t, others, x)
	eventually(t, 10*time.Second, "every other member resolves chat to x again", allResolve)
	// (chat may also come back from x's own re-advertisement, before the
	// push/pulls' spread start.)
	eventually(t, 5*time.Second, "a push/pull with x back alive, serving chat", func() bool { return pushPulls() > 0 })
}

// A serving node falsely declared dead by every other member refutes its
// death and re-advertises its roles at once, with new sequence numbers:
// gossip brings them back to every member that forgot them. Neither the
// push/pulls with a peer back alive (spread over a minute here) nor its
// refresh (a minute here) nor memberlist's push/pull (an hour) can bring
// them back to every member in time.
func TestRefuterReadvertises(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = 3 * time.Minute
	c.tweak = func(cfg *Config) {
		cfg.PushPullInterval = time.Hour
		cfg.backSpread = time.Minute
	}
	// Enough members that some hear x alive again before x's membership
	// digest makes them push/pull with it (which brings its adverts too).
	others, x := starCluster(t, c, "a", "b", "c", "d", "e", "f", "g", "h", "i")
	serveChatAtX(t, others, x)

	var missing []string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("members not resolving chat to x: %v; x refuted %d times", missing, x.m.stats.refutes.Load())
		}
	})
	for range 3 {
		refutes := x.m.stats.refutes.Load()
		falseDeath(t, others, x)
		eventually(t, 3*time.Second, "every other member resolves chat to x again", func() bool {
			missing = missing[:0]
			for name, n := range others {
				if !n.resolvesTo("chat", "x") {
					missing = append(missing, name)
				}
			}
			return len(missing) == 0
		})
		// What told x: memberlist's log line (its only sign of a refute).
		if x.m.stats.refutes.Load() == refutes {
			t.Fatal("x was declared dead and is back, but noteRefuted never heard of its refute")
		}
	}
}

// serveChatAtX has x serve chat and waits until every other member
// resolves chat to x; it returns that condition.
func serveChatAtX(t *testing.T, others map[string]*testNode, x *testNode) (allResolve func() bool) {
	t.Helper()
	for _, n := range others {
		n.tab.AllowRemoteNode("chat", "x", true)
	}
	x.serve(t, "chat", "m")
	allResolve = func() bool {
		for _, n := range others {
			if !n.resolvesTo("chat", "x") {
				return false
			}
		}
		return true
	}
	// A member may miss the advert's broadcast (UDP, on a loaded host)
	// and periodic push/pull is a minute away or more: one with x repairs
	// it.
	eventually(t, 10*time.Second, "every other member resolves chat to x", func() bool {
		if x.m.bcast.NumQueued() != 0 {
			return false
		}
		for _, n := range others {
			if !n.resolvesTo("chat", "x") {
				n.m.ml.Join([]string{x.m.GossipAddr()})
			}
		}
		return allResolve()
	})
	return allResolve
}
