package mesh

import (
	"bytes"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

// TestReplayAfterWithdrawalAndRestartIsRefused: b withdraws role x, then
// restarts; by then a has garbage-collected its records of b's adverts.
// c (any gossip key holder) replays b's old, validly signed x advert: a
// refuses it as stale and never routes x to b again.
func TestReplayAfterWithdrawalAndRestartIsRefused(t *testing.T) {
	c := newTestCluster(t)
	c.ttl = time.Second // records are collected 3 TTLs after b is gone
	nodes := cluster(t, c, "a", "b", "c")
	a, b, cn := nodes[0], nodes[1], nodes[2]
	for _, r := range []string{"x", "y"} {
		a.tab.AllowRemoteNode(r, "b", true)
		b.serve(t, r, "m")
	}
	eventually(t, 5*time.Second, "a resolves x and y to b", func() bool { return a.resolvesTo("x", "b") && a.resolvesTo("y", "b") })
	old := bytes.Clone(heldAdvert(a, "b", "x").msg)
	if old == nil {
		t.Fatal("a holds no x advert of b")
	}

	b.tab.DeregisterLocal("x")
	eventually(t, 5*time.Second, "a forgets withdrawn x", func() bool { return !a.resolvesTo("x", "b") })

	// b restarts; a's records of b are collected meanwhile.
	cfg := b.m.cfg
	if err := b.m.Close(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a collects b's records", func() bool {
		a.m.advMu.Lock()
		defer a.m.advMu.Unlock()
		for k := range a.m.adverts {
			if k.origin == "b" {
				return false
			}
		}
		return true
	})
	cfg.BindAddr = b.m.GossipAddr()
	b2 := c.start(cfg)
	b2.tab.AllowRemoteNode("y", "a", true)
	b2.serve(t, "y", "m")
	b2.join(t, a)
	eventually(t, 10*time.Second, "a resolves y to the restarted b", func() bool { return a.resolvesTo("y", "b") })

	stale := a.refusals(reasonStale)
	send(t, cn, a, old)
	eventually(t, 2*time.Second, "a refuses the replayed x advert", func() bool { return a.refusals(reasonStale) > stale })
	if a.resolvesTo("x", "b") {
		t.Fatal("a resolves x to b after the replay")
	}
}

// TestSeqStateSurvivesRestart: what a node knows of an origin's sequence
// numbers and advert set is saved, and a restarted node refuses an old
// advert with it; its own sequence numbers start above the saved floor.
func TestSeqStateSurvivesRestart(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	key := a.m.PublicKey() // any key: the state is keyed by origin key
	now := uint64(time.Now().UnixNano())
	st := SeqState{
		Reserved: now + uint64(time.Hour),
		Origins: map[string]OriginSeq{identity.EncodeKey(key): {
			Node: "b", Max: now, SetSeq: now, Set: []string{"y"},
		}},
	}
	a.m.loadSeqs(st)
	if got := a.m.nextSeq(); got <= st.Reserved {
		t.Errorf("nextSeq = %d after loading floor %d, want above", got, st.Reserved)
	}
	tests := []struct {
		name  string
		body  advertBody
		stale bool
	}{
		{"role the newer set omits", advertBody{Origin: "b", Role: "x", Seq: now - 1}, true},
		{"role the set names", advertBody{Origin: "b", Role: "y", Seq: now - 1}, false},
		{"far older than the newest", advertBody{Origin: "b", Role: "y", Seq: now - uint64(2*c.ttl)}, true},
		{"newer than the set", advertBody{Origin: "b", Role: "x", Seq: now + 1}, false},
	}
	for _, tt := range tests {
		a.m.advMu.Lock()
		why := a.m.checkOriginLocked(key, tt.body)
		a.m.advMu.Unlock()
		if (why != "") != tt.stale {
			t.Errorf("%s: checkOrigin = %q, want stale %v", tt.name, why, tt.stale)
		}
	}
	var saved SeqState
	book := seqBookFunc(func(s SeqState) { saved = s })
	a.m.saveSeqs(book)
	if o := saved.Origins[identity.EncodeKey(key)]; o.Max != now || len(o.Set) != 1 || o.Set[0] != "y" {
		t.Errorf("saved %+v, want the loaded origin", o)
	}
	if saved.Reserved < st.Reserved {
		t.Errorf("saved floor %d below the loaded %d", saved.Reserved, st.Reserved)
	}
}

type seqBookFunc func(SeqState)

func (f seqBookFunc) LoadSeqs() (SeqState, error) { return SeqState{}, nil }
func (f seqBookFunc) SaveSeqs(s SeqState) error   { f(s); return nil }
