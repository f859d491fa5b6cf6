package agent

import (
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
)

// TestRestartedConsumerIsServedAtOnce: a consumer (a) restarts while its
// serving peer (b) runs on. Each time, from the moment the new agent
// resolves chat to b, its requests are served, although b has not heard
// a's new incarnation alive: b's gossip still records the old one's leave,
// but a's QUIC connection proves its key and the trust configuration
// vouches for it. b never refuses a.
func TestRestartedConsumerIsServedAtOnce(t *testing.T) {
	tm := newTestMesh(t, "b", "a") // b is the seed a joins
	ub := startUpstream(t, "model-b", 0)
	roles := map[string]map[string]roleSpec{
		"a": {"chat": {acceptFrom: []string{"b"}}},
		"b": {"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}},
	}
	// Restarted, a takes no part in gossip after its join (its one
	// push/pull with b, which tells it what b serves): b never hears the
	// new incarnation alive (its refutation of the old one's leave) and
	// keeps recording it as gone: the window in which b used to refuse it,
	// held open.
	muted := false
	tm.meshTuning = func(name string, c *mesh.Config) {
		if name == "a" && muted {
			c.WrapTransport = func(nt memberlist.NodeAwareTransport) memberlist.NodeAwareTransport {
				return newMuteAfterJoin(nt)
			}
		}
	}
	b := tm.start("b", roles["b"], false)
	a := tm.start("a", roles["a"], false)
	waitFor(t, "a serves chat from b", func() bool { return a.resolvesTo("chat", "b") && chatOK(t, a) })
	const restarts = 3
	for i := range restarts {
		tm.stop("a")
		waitFor(t, "b forgets a", func() bool { return !slices.Contains(members(b.agent.Mesh()), "a") })
		muted = true
		a = tm.start("a", roles["a"], false)
		waitFor(t, "the new a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
		if b.agent.Mesh().IsAdmitted("a") {
			t.Fatalf("restart %d: b's gossip has the new a alive; the test needs it not to", i)
		}
		for j := range 5 {
			if !chatOK(t, a) {
				t.Fatalf("restart %d, request %d: a's chat request failed", i, j)
			}
		}
	}
	if b.audited(placement.AuditPeerRefused, string(placement.ReasonNotAdmitted)) || b.audited(mesh.AuditQUICRefused, mesh.RefusedNotAdmitted) {
		t.Errorf("b refused the restarted a as not admitted: %+v", b.agent.Audit().Recent())
	}
}

// TestReadyOnceJoined: an agent reports READY once its first round of join
// contacts has ended, so that a restarted consumer already resolves its
// remote roles when systemd (Type=notify) counts it as started, instead of
// answering its first requests with no instance. A node with nobody to
// join is ready at once.
func TestReadyOnceJoined(t *testing.T) {
	tm := newTestMesh(t, "b", "a")
	ub := startUpstream(t, "model-b", 0)
	roles := map[string]map[string]roleSpec{
		"a": {"chat": {acceptFrom: []string{"b"}}},
		"b": {"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}},
	}
	var mu sync.Mutex
	ready := map[string]int{}    // READY=1 lines per node
	resolved := map[string]int{} // of them, with chat resolving to b
	tm.notify = func(name, state string) {
		if state != "READY=1" {
			return
		}
		ok := name == "a" && tm.nodes[name].resolvesTo("chat", "b")
		mu.Lock()
		ready[name]++
		if ok {
			resolved[name]++
		}
		mu.Unlock()
	}
	readyCount := func(name string) int { mu.Lock(); defer mu.Unlock(); return ready[name] }
	tm.start("b", roles["b"], false)
	waitFor(t, "b, with nobody to join, ready", func() bool { return readyCount("b") == 1 })
	// b's READY does not wait for its instance: its advert enters its mesh
	// state at the advertiser's first round after the upstream is found
	// healthy. A join before that rightly finds nothing to resolve, so a
	// starts once b has advertised: two advertiser rounds ended after the
	// role was seen in b's table (the first may have begun before it).
	b := tm.nodes["b"]
	waitFor(t, "b serves chat itself", func() bool {
		return slices.ContainsFunc(b.agent.Table().Advertisements(), func(ad placement.Advert) bool {
			return ad.Node == "b" && ad.Role() == "chat"
		})
	})
	rounds := b.agent.Mesh().GossipStats().AdvertRounds
	waitFor(t, "b advertised chat", func() bool { return b.agent.Mesh().GossipStats().AdvertRounds >= rounds+2 })
	tm.start("a", roles["a"], false)
	waitFor(t, "a ready", func() bool { return readyCount("a") == 1 })
	for i := range 2 {
		tm.stop("a")
		tm.start("a", roles["a"], false)
		waitFor(t, "a ready again", func() bool { return readyCount("a") == i+2 })
	}
	mu.Lock()
	defer mu.Unlock()
	if resolved["a"] != ready["a"] {
		t.Errorf("a resolved chat to b at %d of its %d READY notifications, want every one", resolved["a"], ready["a"])
	}
}

// muteAfterJoin is a gossip transport that takes no part in gossip but
// for its first outgoing stream (the join's push/pull): its packets are
// dropped, its further streams fail, and streams to it are closed unread
// (a peer's rejoin attempt, a push/pull, would carry its refutation of the
// old incarnation's leave). Packets to it are delivered.
type muteAfterJoin struct {
	memberlist.NodeAwareTransport
	dialed  atomic.Bool
	streams chan net.Conn // never sent on
	done    chan struct{}
	wg      sync.WaitGroup
}

var errMuted = errors.New("gossip muted after the join (test)")

func newMuteAfterJoin(inner memberlist.NodeAwareTransport) *muteAfterJoin {
	m := &muteAfterJoin{NodeAwareTransport: inner, streams: make(chan net.Conn), done: make(chan struct{})}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		for {
			select {
			case c := <-inner.StreamCh():
				_ = c.Close()
			case <-m.done:
				return
			}
		}
	}()
	return m
}

func (m *muteAfterJoin) StreamCh() <-chan net.Conn { return m.streams }

// Shutdown stops the inner transport first: its listener may be waiting
// to hand over a stream, which the loop above takes until then.
func (m *muteAfterJoin) Shutdown() error {
	err := m.NodeAwareTransport.Shutdown()
	close(m.done)
	m.wg.Wait()
	return err
}

func (m *muteAfterJoin) WriteTo(b []byte, addr string) (time.Time, error) {
	return time.Now(), nil
}

func (m *muteAfterJoin) WriteToAddress(b []byte, addr memberlist.Address) (time.Time, error) {
	return time.Now(), nil
}

func (m *muteAfterJoin) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	if m.dialed.Swap(true) {
		return nil, errMuted
	}
	return m.NodeAwareTransport.DialTimeout(addr, timeout)
}

func (m *muteAfterJoin) DialAddressTimeout(addr memberlist.Address, timeout time.Duration) (net.Conn, error) {
	if m.dialed.Swap(true) {
		return nil, errMuted
	}
	return m.NodeAwareTransport.DialAddressTimeout(addr, timeout)
}
