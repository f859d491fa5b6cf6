package agent

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infermesh/infermesh/mesh"
)

// freezableConn is a node's QUIC socket that the test can freeze: while
// frozen, every packet in and out is dropped, as when the process is
// stopped (SIGSTOP) with its socket open: peers' packets go unanswered and
// nothing closes the connection.
type freezableConn struct {
	net.PacketConn
	frozen atomic.Bool
}

func (c *freezableConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || !c.frozen.Load() {
			return n, addr, err
		}
	}
}

func (c *freezableConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if c.frozen.Load() {
		return len(p), nil
	}
	return c.PacketConn.WriteTo(p, addr)
}

// A peer whose QUIC packets stop flowing (a stopped process, gossip still
// saying it is alive) costs a request about the progress bound, not the
// transport's 6 s idle timeout: the attempt sees no response headers,
// asks the peer whether it is alive, gets no answer, and moves on; the
// peer is then tried after the others by every request. Once it flows
// again it serves again. A slow model on a live peer is not cut.
func TestRemoteFrozenPeerIsSkippedQuickly(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	tm.quicDefaults = true
	ub := startUpstream(t, "model-b", 0)
	uc := startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, true)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })
	if idle := mesh.DefaultMaxIdleTimeout; idle < 5*time.Second {
		t.Fatalf("QUIC idle timeout %v: the test needs the default's length to tell the bound from it", idle)
	}

	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := c.Chat.Completions.New(ctx, chatReq("chat")); err != nil {
		t.Fatal(err)
	}
	if ub.requests.Load() != 1 {
		t.Fatalf("before the freeze: b served %d, c %d; want b first", ub.requests.Load(), uc.requests.Load())
	}

	b.frozen.frozen.Store(true)
	const n = 8
	var slowest time.Duration
	for i := range n {
		t0 := time.Now()
		if _, err := c.Chat.Completions.New(ctx, chatReq("chat")); err != nil {
			t.Fatalf("request %d while b is frozen: %v", i, err)
		}
		slowest = max(slowest, time.Since(t0))
	}
	// The bound is 1 s for headers plus 1 s for the probe; the idle
	// timeout is 6 s. 4.5 s leaves room for a loaded machine and still
	// fails if any request waited for the idle timeout.
	if slowest >= 4500*time.Millisecond {
		t.Errorf("slowest request while b was frozen took %v: it waited for the idle timeout, not the progress bound", slowest)
	}
	if got := uc.requests.Load(); got != n {
		t.Errorf("c served %d of %d requests while b was frozen", got, n)
	}
	if got := ub.requests.Load(); got != 1 {
		t.Errorf("b's model saw %d requests; the frozen agent forwarded none, want 1", got)
	}
	order := a.agent.scorer.Resolve("chat")
	if len(order) != 2 || order[0].Node != "c" {
		t.Errorf("a's order for chat while b is frozen = %+v, want c first", order)
	}
	t.Logf("slowest request while b was frozen: %v", slowest)

	// b thaws: once its cool-down ends it is tried again, and serves.
	b.frozen.frozen.Store(false)
	waitFor(t, "b serves again after it thawed", func() bool {
		if _, err := c.Chat.Completions.New(ctx, chatReq("chat")); err != nil {
			t.Fatalf("request after b thawed: %v", err)
		}
		return ub.requests.Load() > 1
	})
}

// A live peer whose model takes longer than the progress bound to answer
// is waited for: the probe is answered, the request is not cut or retried.
func TestRemoteSlowModelIsNotCut(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	a, ub := slowPeer(t, tm)
	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t0 := time.Now()
	if _, err := c.Chat.Completions.New(ctx, chatReq("chat")); err != nil {
		t.Fatal(err)
	}
	took := time.Since(t0)
	if took < 2*time.Second {
		t.Fatalf("the slow model answered in %v: it must take longer than two progress periods for the test to mean anything", took)
	}
	if got := ub.requests.Load(); got != 1 {
		t.Errorf("b's model saw %d requests, want 1 (no retry)", got)
	}
	for _, p := range a.agent.PeerScores() {
		if p.Node == "b" && (p.Failures > 0 || p.CooledDown) {
			t.Errorf("a's view of b after a slow answer = %+v, want no failure", p)
		}
	}
}

// A peer that is stopping drains the requests it has: its answer to the
// progress check says it is leaving, which is an answer, so a slow
// request it is still serving is waited for, not cut.
func TestRemoteSlowRequestOnDrainingPeerIsNotCut(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.shutdown = 60 * time.Second
	a, ub := slowPeer(t, tm)
	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, err := c.Chat.Completions.New(ctx, chatReq("chat"))
		errc <- err
	}()
	waitFor(t, "b's model has the request", func() bool { return ub.requests.Load() == 1 })
	tm.nodes["b"].cancel() // SIGTERM: b leaves and drains
	if err := <-errc; err != nil {
		t.Fatalf("the request b was draining: %v", err)
	}
	if got := ub.cancelled.Load(); got != 0 {
		t.Errorf("b's model saw %d requests cancelled, want 0", got)
	}
}

// slowPeer starts a, and b serving chat to a from a model that takes about
// 3 s before its response headers (8 tokens, 450 ms apart).
func slowPeer(t *testing.T, tm *testMesh) (*meshNode, *testUpstream) {
	t.Helper()
	ub := startUpstream(t, "model-b", 450*time.Millisecond)
	a, _ := tm.chatFromB(ub)
	return a, ub
}

// A live peer that has as many of our requests open as it allows streams
// (mesh.max_streams_per_peer), all waiting on a slow model, is not cut:
// the progress check has no stream left to ask on until one of them ends,
// and a peer that answers nothing new while it holds every stream is no
// silent peer (its packets keep arriving).
func TestRemoteSlowModelAtStreamLimitIsNotCut(t *testing.T) {
	const streams = 4
	tm := newTestMesh(t, "a", "b")
	tm.transportTuning = func(name string, c *mesh.TransportConfig) {
		if name == "b" {
			c.MaxStreamsPerPeer = streams
		}
	}
	a, ub := slowPeer(t, tm)
	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	errs := make(chan error, streams)
	for range streams {
		go func() {
			_, err := c.Chat.Completions.New(ctx, chatReq("chat"))
			errs <- err
		}()
	}
	for i := range streams {
		if err := <-errs; err != nil {
			t.Errorf("request %d of %d at b's stream limit: %v", i+1, streams, err)
		}
	}
	if got := ub.requests.Load(); got != streams {
		t.Errorf("b's model saw %d requests, want %d (no retry)", got, streams)
	}
	for _, p := range a.agent.PeerScores() {
		if p.Node == "b" && (p.Failures > 0 || p.CooledDown) {
			t.Errorf("a's view of b after slow answers = %+v, want no failure", p)
		}
	}
}
