package mesh

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/identity"
)

// memBook is a PeerBook in memory (the agent's is in its state store).
type memBook struct {
	mu    sync.Mutex
	peers []KnownPeer
	saves int
}

func (b *memBook) LoadPeers() ([]KnownPeer, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.peers), nil
}

func (b *memBook) SavePeers(p []KnownPeer) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.peers = slices.Clone(p)
	b.saves++
	return nil
}

func (b *memBook) names() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, p := range b.peers {
		out = append(out, p.Name)
	}
	slices.Sort(out)
	return out
}

// partitionable wraps a node's real UDP/TCP gossip transport: while cut,
// every packet in and out is dropped and every stream refused, as if the
// node's network were unplugged; while deaf, only the packets coming in
// are dropped.
type partitionable struct {
	memberlist.NodeAwareTransport
	cut     atomic.Bool
	deaf    atomic.Bool
	dropped atomic.Int64 // packets dropped while cut or deaf
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	wg      sync.WaitGroup
}

var errCut = errors.New("partitioned (test)")

func newPartitionable(inner memberlist.NodeAwareTransport) *partitionable {
	p := &partitionable{NodeAwareTransport: inner, packets: make(chan *memberlist.Packet), streams: make(chan net.Conn), done: make(chan struct{})}
	p.wg.Add(2)
	go func() {
		defer p.wg.Done()
		for {
			select {
			case pk := <-inner.PacketCh():
				if p.cut.Load() || p.deaf.Load() {
					p.dropped.Add(1)
					continue
				}
				select {
				case p.packets <- pk:
				case <-p.done:
					return
				}
			case <-p.done:
				return
			}
		}
	}()
	go func() {
		defer p.wg.Done()
		for {
			select {
			case c := <-inner.StreamCh():
				if p.cut.Load() {
					_ = c.Close()
					continue
				}
				select {
				case p.streams <- c:
				case <-p.done:
					_ = c.Close()
					return
				}
			case <-p.done:
				return
			}
		}
	}()
	return p
}

func (p *partitionable) PacketCh() <-chan *memberlist.Packet { return p.packets }
func (p *partitionable) StreamCh() <-chan net.Conn           { return p.streams }

func (p *partitionable) WriteTo(b []byte, addr string) (time.Time, error) {
	if p.cut.Load() {
		return time.Now(), nil // lost on the wire
	}
	return p.NodeAwareTransport.WriteTo(b, addr)
}

func (p *partitionable) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	if p.cut.Load() {
		return time.Now(), nil
	}
	return p.NodeAwareTransport.WriteToAddress(b, a)
}

func (p *partitionable) DialTimeout(addr string, d time.Duration) (net.Conn, error) {
	if p.cut.Load() {
		return nil, errCut
	}
	return p.NodeAwareTransport.DialTimeout(addr, d)
}

func (p *partitionable) DialAddressTimeout(a memberlist.Address, d time.Duration) (net.Conn, error) {
	if p.cut.Load() {
		return nil, errCut
	}
	return p.NodeAwareTransport.DialAddressTimeout(a, d)
}

func (p *partitionable) Shutdown() error {
	err := p.NodeAwareTransport.Shutdown()
	close(p.done)
	p.wg.Wait()
	return err
}

// accepts lets n hear role r<o> from every other node o.
func (n *testNode) accepts(names ...string) {
	for _, o := range names {
		if o != n.name {
			n.tab.AllowRemoteNode("r"+o, o, true)
		}
	}
}

// healing starts Heal for n with book until the test ends.
func (n *testNode) healing(t *testing.T, book PeerBook) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = n.m.Heal(ctx, HealOptions{Peers: book})
	}()
	t.Cleanup(func() { cancel(); <-done })
}

func healConfig(c *testCluster, name string) Config {
	cfg := c.config(name)
	cfg.RejoinInterval = 100 * time.Millisecond
	cfg.RejoinMaxBackoff = 400 * time.Millisecond
	cfg.Certificate = c.certFor(cfg, identity.ScopeFull, time.Hour)
	return cfg
}

// seesAll reports whether n lists every one of names as a member.
func seesAll(n *testNode, names ...string) bool {
	got := memberNames(n.m)
	for _, w := range names {
		if !slices.Contains(got, w) {
			return false
		}
	}
	return true
}

// TestRestartEachNodeReforms: a 3-node mesh where a is the seed (it joins
// nobody; b and c join a). Each node in turn, the seed first, is stopped
// and started again on the same address with its peer book: the mesh
// re-forms and adverts flow again with nobody running join.
func TestRestartEachNodeReforms(t *testing.T) {
	c := newTestCluster(t)
	books := map[string]*memBook{"a": {}, "b": {}, "c": {}}
	cfgs := map[string]Config{}
	nodes := map[string]*testNode{}
	start := func(name string) {
		n := c.start(cfgs[name])
		n.serve(t, "r"+name, "m")
		n.accepts("a", "b", "c")
		n.healing(t, books[name])
		nodes[name] = n
	}
	cfgs["a"] = healConfig(c, "a")
	start("a")
	cfgs["a"] = withAddr(cfgs["a"], nodes["a"].m.GossipAddr())
	for _, name := range []string{"b", "c"} {
		cfg := healConfig(c, name)
		cfg.Join = []string{nodes["a"].m.GossipAddr()}
		cfgs[name] = cfg
		start(name)
		cfgs[name] = withAddr(cfgs[name], nodes[name].m.GossipAddr())
	}
	all := []string{"a", "b", "c"}
	converged := func(what string) {
		t.Helper()
		eventually(t, 30*time.Second, what, func() bool { return whole(nodes, all) })
	}
	converged("the mesh forms")
	// Every node persisted the two others.
	for name, b := range books {
		eventually(t, 10*time.Second, name+" saves its peers", func() bool { return len(b.names()) == 2 })
	}
	for _, name := range all {
		if err := nodes[name].m.Close(); err != nil {
			t.Fatalf("close %s: %v", name, err)
		}
		// The others declare it dead (no leave message): like kill -9.
		for _, o := range all {
			if o != name {
				eventually(t, 30*time.Second, o+" sees "+name+" gone", func() bool { return !nodes[o].resolvesTo("r"+name, name) })
			}
		}
		start(name)
		converged("the mesh re-forms after restarting " + name)
	}
}

// whole reports whether every node lists every other and resolves each
// one's role r<name> to it.
func whole(nodes map[string]*testNode, names []string) bool {
	for _, n := range nodes {
		if !seesAll(n, names...) {
			return false
		}
		for _, o := range names {
			if o != n.name && !n.resolvesTo("r"+o, o) {
				return false
			}
		}
	}
	return true
}

// withAddr pins cfg's gossip address to addr (the port bound the first
// time), so a restart comes back where its peers know it.
func withAddr(cfg Config, addr string) Config {
	cfg.BindAddr = addr
	return cfg
}

// TestPartitionHeals: c is cut off from a and b for long enough that both
// sides declare the other dead and memberlist stops gossiping to the dead
// (GossipToTheDeadTime, 30s); once the cut is lifted the mesh merges again
// by itself.
func TestPartitionHeals(t *testing.T) {
	c := newTestCluster(t)
	var cut *partitionable
	names := []string{"a", "b", "c"}
	nodes := map[string]*testNode{}
	for i, name := range names {
		cfg := healConfig(c, name)
		if name == "c" {
			cfg.WrapTransport = func(nt memberlist.NodeAwareTransport) memberlist.NodeAwareTransport {
				cut = newPartitionable(nt)
				return cut
			}
		}
		if i > 0 {
			cfg.Join = []string{nodes["a"].m.GossipAddr()}
		}
		n := c.start(cfg)
		n.serve(t, "r"+name, "m")
		n.accepts(names...)
		n.healing(t, &memBook{})
		nodes[name] = n
	}
	eventually(t, 30*time.Second, "the mesh forms", func() bool { return whole(nodes, names) })

	cut.cut.Store(true)
	cutAt := time.Now()
	eventually(t, 30*time.Second, "a and b declare c dead", func() bool {
		return !slices.Contains(memberNames(nodes["a"].m), "c") && !slices.Contains(memberNames(nodes["b"].m), "c")
	})
	eventually(t, 30*time.Second, "c declares a and b dead", func() bool { return len(memberNames(nodes["c"].m)) == 1 })
	// Stay cut for 30s in all.
	time.Sleep(time.Until(cutAt.Add(30 * time.Second)))
	cut.cut.Store(false)
	healedAt := time.Now()
	eventually(t, 30*time.Second, "the mesh merges again", func() bool { return whole(nodes, names) })
	t.Logf("merged %v after the partition ended", time.Since(healedAt).Round(10*time.Millisecond))
}

// TestExpiredOwnCertificateDoesNotJoin: a node whose own certificate has
// expired says so and does not try to join (every peer would refuse it);
// CertificateExpiry reports the expiry for the metric.
func TestExpiredOwnCertificateDoesNotJoin(t *testing.T) {
	c := newTestCluster(t)
	a := c.node("a")
	cfg := healConfig(c, "x") // a certificate valid for an hour
	cfg.Join = []string{a.m.GossipAddr()}
	x := c.start(cfg)
	exp, ok := x.m.CertificateExpiry()
	if !ok || exp.Before(time.Now()) {
		t.Fatalf("CertificateExpiry() = %v, %v; want an hour ahead", exp, ok)
	}
	x.clock.Advance(2 * time.Hour) // x's clock: its certificate has expired
	x.healing(t, nil)
	// Heal runs every 100ms here: give it many rounds.
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if len(x.m.ml.Members()) > 1 || a.refusals(reasonUnadmitted) > 0 {
			t.Fatal("x tried to join with an expired certificate")
		}
		time.Sleep(20 * time.Millisecond)
	}
	x.clock.Advance(-2 * time.Hour) // valid again: it joins
	eventually(t, 5*time.Second, "x joins once its certificate is valid", func() bool { return a.m.IsAdmitted("x") })
}

// TestHealReportsItsFirstRound: OnFirstRound is called once, when every
// first contact has ended, with how many there were: joined is true once a
// configured address answered (and the node then lists its peer), false
// when the only one is dead, and false at once when there is nobody to
// contact.
func TestHealReportsItsFirstRound(t *testing.T) {
	c := newTestCluster(t)
	a := c.start(healConfig(c, "a"))
	dead, err := net.Listen("tcp", "127.0.0.1:0") // closed at once: refuses
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	dead.Close()
	tests := []struct {
		name    string
		join    []string
		targets int
		want    bool
	}{
		{"nobody to contact", nil, 0, false},
		{"a live peer", []string{a.m.GossipAddr()}, 1, true},
		{"a dead address only", []string{deadAddr}, 1, false},
		{"a live peer and a dead address", []string{deadAddr, a.m.GossipAddr()}, 2, true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := healConfig(c, fmt.Sprintf("n%d", i))
			cfg.Join = tt.join
			n := c.start(cfg)
			got := make(chan bool, 2)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = n.m.Heal(ctx, HealOptions{OnFirstRound: func(targets int, joined bool) {
					if joined && !slices.Contains(memberNames(n.m), "a") {
						t.Errorf("first round joined, but %s does not list a", n.name)
					}
					if targets != tt.targets {
						t.Errorf("OnFirstRound: %d targets, want %d", targets, tt.targets)
					}
					got <- joined
				}})
			}()
			defer func() { cancel(); <-done }()
			select {
			case j := <-got:
				if j != tt.want {
					t.Errorf("OnFirstRound(%v), want %v", j, tt.want)
				}
			case <-time.After(15 * time.Second * loadFactor):
				t.Fatal("OnFirstRound was not called")
			}
			// Later rounds do not call it again (a dead address is retried
			// every RejoinInterval).
			cancel()
			<-done
			if len(got) != 0 {
				t.Errorf("OnFirstRound called %d more times", len(got))
			}
		})
	}
}

// TestHealFirstRoundWaitsForALivePeersState: a peer whose own contact
// reached this node first is live here before its push/pull state (what
// it serves) is merged. The first round must not report the node joined,
// nor as having nobody to contact, on that alone: a's merge of b's
// contact is held once b is live at a, and a's first round must report
// joined with b's role already resolved.
func TestHealFirstRoundWaitsForALivePeersState(t *testing.T) {
	c := newTestCluster(t)
	b := c.start(healConfig(c, "b"))
	b.serve(t, "rb", "m")
	cfg := healConfig(c, "a")
	cfg.Join = []string{b.m.GossipAddr()}
	// a hears no gossip packets: b's adverts reach it only in push/pull
	// state (streams), which the hook below holds; probes fall back to TCP.
	cfg.WrapTransport = func(inner memberlist.NodeAwareTransport) memberlist.NodeAwareTransport {
		p := newPartitionable(inner)
		p.deaf.Store(true)
		return p
	}
	a := c.start(cfg)
	a.accepts("b")
	// b holds its own advert before contacting a (else its push/pull
	// carries nothing to wait for).
	eventually(t, 10*time.Second, "b advertises rb", func() bool {
		b.m.advMu.Lock()
		defer b.m.advMu.Unlock()
		return b.m.adverts[advertKey{"b", "rb"}] != nil
	})
	release := make(chan struct{})
	var held atomic.Bool
	hook := func(m *Mesh) {
		if m == a.m && held.CompareAndSwap(false, true) {
			<-release
		}
	}
	testHookMergeRemoteState.Store(&hook)
	var releaseOnce sync.Once
	unhold := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(func() { unhold(); testHookMergeRemoteState.Store(nil) })

	joinDone := make(chan struct{})
	go func() {
		defer close(joinDone)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = b.m.JoinAddrs(ctx, []string{a.m.GossipAddr()})
	}()
	t.Cleanup(func() { <-joinDone })
	eventually(t, 10*time.Second, "b is live at a, its state held", func() bool {
		return held.Load() && slices.Contains(memberNames(a.m), "b")
	})
	if a.resolvesTo("rb", "b") {
		t.Fatal("a resolves rb to b before any state was merged: the test holds nothing")
	}

	type report struct {
		targets          int
		joined, resolved bool
	}
	got := make(chan report, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = a.m.Heal(ctx, HealOptions{OnFirstRound: func(targets int, joined bool) {
			got <- report{targets, joined, a.resolvesTo("rb", "b")}
		}})
	}()
	defer func() { cancel(); <-done }()
	select {
	case r := <-got:
		if !r.joined || !r.resolved {
			t.Errorf("first round: %d targets, joined %v, rb resolved to b %v; want joined with rb resolved", r.targets, r.joined, r.resolved)
		}
	case <-time.After(15 * time.Second * loadFactor):
		t.Fatal("OnFirstRound was not called")
	}
	unhold()
}
