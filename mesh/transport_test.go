package mesh

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// staticDir is a PeerDirectory the test edits.
type staticDir struct {
	mu    sync.RWMutex
	nodes map[string]dirEntry
}

type dirEntry struct {
	addr     string
	key      ed25519.PublicKey
	admitted bool
}

func newStaticDir() *staticDir { return &staticDir{nodes: map[string]dirEntry{}} }

func (d *staticDir) set(name string, e dirEntry) {
	d.mu.Lock()
	d.nodes[name] = e
	d.mu.Unlock()
}

func (d *staticDir) revoke(name string) {
	d.mu.Lock()
	e := d.nodes[name]
	e.admitted = false
	d.nodes[name] = e
	d.mu.Unlock()
}

func (d *staticDir) get(name string) (dirEntry, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	e, ok := d.nodes[name]
	return e, ok && e.admitted
}

func (d *staticDir) PeerAddr(node string) (string, bool) {
	e, ok := d.get(node)
	return e.addr, ok && e.addr != ""
}

// TrustsKey: the fake directory trusts exactly the keys it lists.
func (d *staticDir) TrustsKey(n string, key ed25519.PublicKey) bool {
	k, ok := d.PeerKey(n)
	return ok && k.Equal(key)
}

func (d *staticDir) PeerKey(node string) (ed25519.PublicKey, bool) {
	e, ok := d.get(node)
	return e.key, ok
}

func (d *staticDir) IsAdmitted(node string) bool {
	_, ok := d.get(node)
	return ok
}

// refusalLog records OnRefused calls.
type refusalLog struct {
	mu   sync.Mutex
	seen []string // "peer/why"
}

func (l *refusalLog) add(peer, why string) {
	l.mu.Lock()
	l.seen = append(l.seen, peer+"/"+why)
	l.mu.Unlock()
}

func (l *refusalLog) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Contains(l.seen, s)
}

func (l *refusalLog) hasPrefix(p string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.seen, func(s string) bool { return strings.HasPrefix(s, p) })
}

func (l *refusalLog) hasWhy(why string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.seen, func(s string) bool { return strings.HasSuffix(s, "/"+why) })
}

type tnode struct {
	name    string
	key     ed25519.PrivateKey
	tr      *Transport
	refused *refusalLog
	pc      net.PacketConn // set when the test owns the socket
}

var nextTransportIP atomic.Int32

// transportConfigForTest fills a fast config: short keep-alive and idle
// timeout so dead peers are noticed within a second.
func transportConfigForTest(name string, key ed25519.PrivateKey, dir PeerDirectory, h http.Handler) TransportConfig {
	ip := 10 + nextTransportIP.Add(1)%200
	return TransportConfig{
		Name:             name,
		Key:              key,
		Listen:           fmt.Sprintf("127.0.0.%d:0", ip),
		Peers:            dir,
		Handler:          h,
		HandshakeTimeout: time.Second,
		KeepAlivePeriod:  100 * time.Millisecond,
		MaxIdleTimeout:   600 * time.Millisecond,
		RecheckInterval:  50 * time.Millisecond,
	}
}

func newKey(t testing.TB) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// startNode starts a serving transport named name, registers it in dir
// (admitted) and stops it at cleanup.
func startNode(t testing.TB, dir *staticDir, name string, h http.Handler, tweak func(*TransportConfig)) *tnode {
	t.Helper()
	n := &tnode{name: name, key: newKey(t), refused: &refusalLog{}}
	cfg := transportConfigForTest(name, n.key, dir, h)
	cfg.OnRefused = n.refused.add
	if tweak != nil {
		tweak(&cfg)
	}
	n.pc = cfg.PacketConn
	tr, err := NewTransport(cfg)
	if err != nil {
		t.Fatalf("NewTransport(%s): %v", name, err)
	}
	n.tr = tr
	dir.set(name, dirEntry{addr: tr.Addr().String(), key: n.key.Public().(ed25519.PublicKey), admitted: true})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tr.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		// A test that owns the socket may have closed it ("killed" the
		// node): then Serve rightly reports that its listener failed.
		// A test that closes the transport before Serve ran gets
		// ErrTransportClosed from it.
		if err := <-done; err != nil && n.pc == nil && !errors.Is(err, ErrTransportClosed) {
			t.Errorf("%s: Serve: %v", name, err)
		}
		if err := tr.Close(); err != nil {
			t.Errorf("%s: Close: %v", name, err)
		}
	})
	return n
}

func post(ctx context.Context, tr http.RoundTripper, node, body string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+node+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Infermesh-Role", "chat")
	return tr.RoundTrip(req)
}

// echoHandler answers with the verified peer, the role header and the body.
func echoHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		peer, ok := PeerFromRequest(r)
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "peer=%s ok=%v role=%s body=%s", peer, ok, r.Header.Get("Infermesh-Role"), b)
	})
}

func TestTransportRoundTripVerifiedPeerAndReuse(t *testing.T) {
	dir := newStaticDir()
	var conns atomic.Int32
	b := startNode(t, dir, "b", echoHandler(), nil)
	a := startNode(t, dir, "a", nil, nil)
	ctx := context.Background()
	for i := range 3 {
		resp, err := post(ctx, a.tr, "b", fmt.Sprintf(`{"n":%d}`, i))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := fmt.Sprintf(`peer=a ok=true role=chat body={"n":%d}`, i); string(got) != want {
			t.Errorf("request %d: body = %q, want %q", i, got, want)
		}
		if resp.Proto != "HTTP/3.0" {
			t.Errorf("proto = %q, want HTTP/3.0", resp.Proto)
		}
	}
	b.tr.mu.Lock()
	conns.Store(int32(len(b.tr.served)))
	b.tr.mu.Unlock()
	if got := conns.Load(); got != 1 {
		t.Errorf("b serves %d connections after 3 requests from a, want 1 (reused)", got)
	}
}

func TestTransportStreamsEventByEvent(t *testing.T) {
	dir := newStaticDir()
	next := make(chan struct{})
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			if err := rc.Flush(); err != nil {
				return
			}
			select {
			case <-next: // the client saw this event before we write the next one
			case <-r.Context().Done():
				return
			}
		}
	}), nil)
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if want := fmt.Sprintf("data: %d\n", i); line != want {
			t.Errorf("event %d = %q, want %q", i, line, want)
		}
		_, _ = br.ReadString('\n')
		next <- struct{}{}
	}
	if _, err := br.ReadString('\n'); err != io.EOF {
		t.Errorf("after the last event: err = %v, want io.EOF", err)
	}
}

func TestTransportHandshakeRefusals(t *testing.T) {
	dir := newStaticDir()
	var served atomic.Int32
	b := startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served.Add(1) }), nil)

	tests := []struct {
		name    string
		cert    func(t *testing.T) []tls.Certificate
		wantWhy string
		wantWho string
	}{
		{"no certificate", func(t *testing.T) []tls.Certificate { return nil }, RefusedNoCertificate, "addr:"},
		{"unadmitted key", func(t *testing.T) []tls.Certificate {
			c, err := NodeCertificate("mallory", newKey(t))
			if err != nil {
				t.Fatal(err)
			}
			return []tls.Certificate{c}
		}, RefusedNotAdmitted, "mallory"},
		{"revoked node", func(t *testing.T) []tls.Certificate {
			k := newKey(t)
			dir.set("eve", dirEntry{key: k.Public().(ed25519.PublicKey), admitted: false})
			c, err := NodeCertificate("eve", k)
			if err != nil {
				t.Fatal(err)
			}
			return []tls.Certificate{c}
			// Same source (127.0.0.1) and reason as mallory's, within the
			// audit interval: counted, not reported again under the new
			// name (a flood cannot choose its way past the rate limit).
		}, RefusedNotAdmitted, "mallory"},
		{"admitted name, other key", func(t *testing.T) []tls.Certificate {
			dir.set("carol", dirEntry{key: newKey(t).Public().(ed25519.PublicKey), admitted: true})
			c, err := NodeCertificate("carol", newKey(t))
			if err != nil {
				t.Fatal(err)
			}
			return []tls.Certificate{c}
		}, RefusedKeyMismatch, "carol"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tc := &tls.Config{
				Certificates:       tt.cert(t),
				InsecureSkipVerify: true,
				NextProtos:         []string{http3.NextProtoH3},
				MinVersion:         tls.VersionTLS13,
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			conn, err := quic.DialAddr(ctx, b.tr.Addr().String(), tc, &quic.Config{})
			if err == nil {
				// TLS 1.3: the client finishes before the server has checked its
				// certificate; the refusal arrives as the connection closing.
				rt := (&http3.Transport{}).NewClientConn(conn)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://b/v1/chat/completions", strings.NewReader("{}"))
				resp, rerr := rt.RoundTrip(req)
				if rerr == nil {
					resp.Body.Close()
					t.Fatalf("request over a refused handshake got status %d, want a failure", resp.StatusCode)
				}
				conn.CloseWithError(0, "")
			}
			eventually(t, 2*time.Second, "refusal reported", func() bool { return b.refused.hasWhy(tt.wantWhy) })
			if !b.refused.hasPrefix(tt.wantWho + "") {
				t.Errorf("refusals: none names %q", tt.wantWho)
			}
		})
	}
	if got := served.Load(); got != 0 {
		t.Errorf("handler served %d requests from refused clients, want 0", got)
	}
	if got := b.tr.Refusals()[RefusedNoCertificate]; got == 0 {
		t.Errorf("Refusals()[%s] = 0, want counted", RefusedNoCertificate)
	}
	if got := b.tr.Refusals()[RefusedNotAdmitted]; got != 2 {
		t.Errorf("Refusals()[%s] = %d, want 2 (mallory and eve)", RefusedNotAdmitted, got)
	}
}

// TestTransportRefusalFloodIsAuditedOnce: handshakes without a certificate
// from 40 fresh source ports of one address are all counted, and reported
// once: the rate limit is keyed on the source address, not its port.
func TestTransportRefusalFloodIsAuditedOnce(t *testing.T) {
	dir := newStaticDir()
	b := startNode(t, dir, "b", echoHandler(), nil)
	for range 40 {
		tc := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{http3.NextProtoH3}, MinVersion: tls.VersionTLS13}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		conn, err := quic.DialAddr(ctx, b.tr.Addr().String(), tc, &quic.Config{})
		if err == nil {
			rt := (&http3.Transport{}).NewClientConn(conn)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://b/v1/chat/completions", strings.NewReader("{}"))
			if resp, err := rt.RoundTrip(req); err == nil {
				resp.Body.Close()
			}
			conn.CloseWithError(0, "")
		}
		cancel()
	}
	eventually(t, 5*time.Second, "every handshake counted", func() bool { return b.tr.Refusals()[RefusedNoCertificate] >= 40 })
	b.refused.mu.Lock()
	n := len(b.refused.seen)
	b.refused.mu.Unlock()
	if n != 1 {
		t.Errorf("%d refusals reported for one source, want 1", n)
	}
}

func TestTransportClientPinsServerKey(t *testing.T) {
	dir := newStaticDir()
	b := startNode(t, dir, "b", echoHandler(), nil)
	a := startNode(t, dir, "a", nil, nil)
	// a's directory believes b has another key: b's certificate must be refused.
	e, _ := dir.get("b")
	e.key = newKey(t).Public().(ed25519.PublicKey)
	dir.set("b", e)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("request to an impostor succeeded with status %d, want an error", resp.StatusCode)
	}
	if !a.refused.has("b/" + RefusedKeyMismatch) {
		t.Errorf("a's refusals = %v, want b/%s", a.refused.seen, RefusedKeyMismatch)
	}
	_ = b
}

func TestTransportUnknownPeer(t *testing.T) {
	dir := newStaticDir()
	a := startNode(t, dir, "a", nil, nil)
	dir.set("gone", dirEntry{addr: "127.0.0.1:1", key: newKey(t).Public().(ed25519.PublicKey), admitted: false})
	tests := []struct{ node string }{{"nobody"}, {"gone"}}
	for _, tt := range tests {
		t.Run(tt.node, func(t *testing.T) {
			_, err := post(context.Background(), a.tr, tt.node, `{}`)
			if !errors.Is(err, ErrUnknownPeer) {
				t.Errorf("RoundTrip to %s: err = %v, want ErrUnknownPeer", tt.node, err)
			}
		})
	}
	req, _ := http.NewRequest(http.MethodPost, "https://b:443/x", nil)
	if _, err := a.tr.RoundTrip(req); err == nil || errors.Is(err, ErrUnknownPeer) {
		t.Errorf("RoundTrip to host with a port: err = %v, want a not-a-node-id error", err)
	}
}

func TestTransportClientCancelReachesPeer(t *testing.T) {
	dir := newStaticDir()
	started := make(chan struct{})
	ended := make(chan struct{})
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: 0\n\n")
		http.NewResponseController(w).Flush()
		close(started)
		<-r.Context().Done()
		close(ended)
	}), nil)
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	cancel()
	select {
	case <-ended:
	case <-time.After(15 * time.Second):
		t.Fatal("b's handler context did not end after a cancelled the request")
	}
}

func TestTransportRevocationClosesLiveConnection(t *testing.T) {
	dir := newStaticDir()
	started := make(chan struct{}, 1)
	b := startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: 0\n\n")
		http.NewResponseController(w).Flush()
		started <- struct{}{}
		<-r.Context().Done()
	}), nil)
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	// b stops admitting a: the live stream is cut, not completed.
	dir.revoke("a")
	_, err = io.ReadAll(resp.Body)
	if err == nil {
		t.Fatal("stream from b ended cleanly after b revoked a, want an error")
	}
	// A new connection is refused at the handshake, and recorded.
	if resp, err := post(ctx, a.tr, "b", `{}`); err == nil {
		resp.Body.Close()
		t.Fatalf("request from revoked a got status %d, want an error", resp.StatusCode)
	}
	eventually(t, 2*time.Second, "b refuses a", func() bool { return b.refused.has("a/" + RefusedNotAdmitted) })
}

func TestTransportPeerKilledAbortsStream(t *testing.T) {
	dir := newStaticDir()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	started := make(chan struct{}, 1)
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: 0\n\n")
		http.NewResponseController(w).Flush()
		started <- struct{}{}
		<-r.Context().Done()
	}), func(c *TransportConfig) { c.PacketConn = pc })
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	// Kill b's socket: no CONNECTION_CLOSE reaches a, like a killed process.
	pc.Close()
	t0 := time.Now()
	_, err = io.ReadAll(resp.Body)
	if err == nil {
		t.Fatal("stream from a killed peer ended cleanly, want an error")
	}
	if ctx.Err() != nil {
		t.Fatalf("the stream only ended with the test's deadline (%v), want the idle timeout", time.Since(t0))
	}
	// A new request fails too (before any response), so a caller can fail over.
	rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer rcancel()
	if resp, err := post(rctx, a.tr, "b", `{}`); err == nil {
		resp.Body.Close()
		t.Fatalf("request to a killed peer got status %d, want an error", resp.StatusCode)
	}
	if rctx.Err() != nil {
		t.Error("request to a killed peer only failed at the test's deadline, want the handshake timeout")
	}
}

func TestTransportCloseIdempotentAndRoundTripAfterClose(t *testing.T) {
	dir := newStaticDir()
	a := startNode(t, dir, "a", nil, nil)
	startNode(t, dir, "b", echoHandler(), nil)
	if err := a.tr.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := a.tr.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := post(context.Background(), a.tr, "b", `{}`); !errors.Is(err, ErrTransportClosed) {
		t.Errorf("RoundTrip after Close: err = %v, want ErrTransportClosed", err)
	}
	if err := a.tr.Serve(context.Background()); !errors.Is(err, ErrTransportClosed) {
		t.Errorf("Serve after Close: err = %v, want ErrTransportClosed", err)
	}
}

func TestTransportConfigValidation(t *testing.T) {
	key := newKey(t)
	dir := newStaticDir()
	good := func() TransportConfig {
		return TransportConfig{Name: "a", Key: key, Listen: "127.0.0.1:0", Peers: dir}
	}
	tests := []struct {
		name  string
		edit  func(*TransportConfig)
		field string
	}{
		{"bad name", func(c *TransportConfig) { c.Name = "a b" }, "Name"},
		{"no key", func(c *TransportConfig) { c.Key = nil }, "Key"},
		{"no peers", func(c *TransportConfig) { c.Peers = nil }, "Peers"},
		{"no listen", func(c *TransportConfig) { c.Listen = "" }, "Listen"},
		{"bad listen", func(c *TransportConfig) { c.Listen = "nope" }, "Listen"},
		{"negative timeout", func(c *TransportConfig) { c.HandshakeTimeout = -1 }, "HandshakeTimeout"},
		{"keepalive not shorter", func(c *TransportConfig) { c.KeepAlivePeriod, c.MaxIdleTimeout = time.Second, time.Second }, "KeepAlivePeriod"},
		{"negative streams", func(c *TransportConfig) { c.MaxStreamsPerPeer = -1 }, "MaxStreamsPerPeer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := good()
			tt.edit(&c)
			tr, err := NewTransport(c)
			if err == nil {
				tr.Close()
				t.Fatalf("NewTransport: nil error, want one naming %s", tt.field)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("NewTransport: err = %v, want it to name %s", err, tt.field)
			}
		})
	}
	tr, err := NewTransport(good())
	if err != nil {
		t.Fatalf("NewTransport(good): %v", err)
	}
	defer tr.Close()
	if tr.cfg.KeepAlivePeriod != DefaultKeepAlivePeriod || tr.cfg.MaxIdleTimeout != DefaultMaxIdleTimeout ||
		tr.cfg.HandshakeTimeout != DefaultHandshakeTimeout || tr.cfg.MaxStreamsPerPeer != DefaultMaxStreamsPerPeer {
		t.Errorf("zero config fields did not take the defaults: %+v", tr.cfg)
	}
}

// TestTransportOverMesh drives the transport with real Mesh directories:
// two nodes admitted by certificate, the QUIC address taken from gossip.
func TestTransportOverMesh(t *testing.T) {
	c := newTestCluster(t)
	var pcs []net.PacketConn
	c.tweak = func(cfg *Config) {
		pc, err := net.ListenPacket("udp", cfg.BindAddr) // same 127.0.0.x as gossip, free port
		if err != nil {
			t.Fatal(err)
		}
		pcs = append(pcs, pc)
		cfg.QUICAddr = pc.LocalAddr().String()
	}
	defer func() {
		for _, pc := range pcs {
			pc.Close()
		}
	}()
	a, b := c.node("a"), c.node("b")
	b.join(t, a)
	eventually(t, 5*time.Second, "a admits b", func() bool { return a.m.IsAdmitted("b") && b.m.IsAdmitted("a") })
	start := func(n *testNode, pc net.PacketConn, h http.Handler) *Transport {
		tr, err := NewTransport(TransportConfig{Name: n.name, Key: n.m.NodeKey(), PacketConn: pc, Peers: n.m, Handler: h,
			KeepAlivePeriod: 100 * time.Millisecond, MaxIdleTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = tr.Serve(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		return tr
	}
	start(b, pcs[1], echoHandler())
	ta := start(a, pcs[0], nil)
	resp, err := post(context.Background(), ta, "b", `{"x":1}`)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := `peer=a ok=true role=chat body={"x":1}`; string(got) != want {
		t.Errorf("body = %q, want %q", got, want)
	}
}

func TestTransportShutdownFinishesInFlightRequests(t *testing.T) {
	dir := newStaticDir()
	started := make(chan struct{})
	release := make(chan struct{})
	b := startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if peer, _ := PeerFromRequest(r); peer == "idle" {
			return
		}
		fmt.Fprint(w, "data: 0\n\n")
		http.NewResponseController(w).Flush()
		close(started)
		<-release
		fmt.Fprint(w, "data: 1\n\n")
	}), nil)
	a := startNode(t, dir, "a", nil, nil)
	idle := startNode(t, dir, "idle", nil, nil)
	// idle holds an open connection to b without a request in flight.
	iresp, err := post(context.Background(), idle.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, iresp.Body)
	iresp.Body.Close()
	resp, err := post(context.Background(), a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- b.tr.Shutdown(ctx) }()
	time.Sleep(100 * time.Millisecond) // Shutdown is under way
	close(release)
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("in-flight stream during Shutdown: %v (got %q)", err, body)
	}
	if want := "data: 0\n\ndata: 1\n\n"; string(body) != want {
		t.Errorf("in-flight stream = %q, want %q", body, want)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("Shutdown did not return once the in-flight request finished (idle peers must close on GOAWAY)")
	}
	if _, err := post(context.Background(), a.tr, "b", `{}`); err == nil {
		t.Error("request after Shutdown succeeded, want an error")
	}
}

// TestTransportServesRestartedPeerBeforeGossipDoes: a peer that left the
// mesh in order and comes back (a restart: same name, same key) is served
// as soon as it asks over QUIC, while gossip here still records its
// leave: its connection proves its key, and the trust configuration
// vouches for it. Gossip liveness is a hint; refusing it would fail every
// request of a restarted node until gossip had spread its new incarnation.
// Revoked, it is refused again at once.
func TestTransportServesRestartedPeerBeforeGossipDoes(t *testing.T) {
	c := newTestCluster(t)
	pcs := map[string]net.PacketConn{}
	c.tweak = func(cfg *Config) {
		pc, err := net.ListenPacket("udp", cfg.BindAddr) // same 127.0.0.x as gossip, free port
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		pcs[cfg.NodeName] = pc
		cfg.QUICAddr = pc.LocalAddr().String()
	}
	a, b := c.node("a"), c.node("b")
	b.join(t, a)
	eventually(t, 5*time.Second, "a and b admit each other", func() bool { return a.m.IsAdmitted("b") && b.m.IsAdmitted("a") })
	refused := &refusalLog{}
	start := func(name string, key ed25519.PrivateKey, pc net.PacketConn, dir PeerDirectory, h http.Handler) *Transport {
		return runTransport(t, TransportConfig{Name: name, Key: key, PacketConn: pc, Peers: dir, Handler: h,
			KeepAlivePeriod: 100 * time.Millisecond, MaxIdleTimeout: time.Second, RecheckInterval: 50 * time.Millisecond,
			OnRefused: refused.add})
	}
	start("b", b.m.NodeKey(), pcs["b"], b.m, echoHandler())
	ask := func(tr *Transport) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := post(ctx, tr, "b", `{}`)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		return string(got), err
	}
	want := `peer=a ok=true role=chat body={}`
	if got, err := ask(start("a", a.m.NodeKey(), pcs["a"], a.m, nil)); err != nil || got != want {
		t.Fatalf("a -> b before the restart: %q, %v; want %q", got, err, want)
	}

	// a leaves in order and stops; b forgets it.
	if err := a.m.Leave(time.Second); err != nil {
		t.Fatal(err)
	}
	a.m.Close()
	eventually(t, 5*time.Second, "b forgets a", func() bool { return !slices.Contains(memberNames(b.m), "a") })
	if b.m.IsAdmitted("a") {
		t.Fatal("b still lists a as a live admitted member after its leave")
	}

	// a's next incarnation asks before gossip has it alive: it never
	// rejoins gossip here at all, and knows b from a static directory.
	dir := NewStaticDirectory()
	bKey := b.m.NodeKey().Public().(ed25519.PublicKey)
	dir.Set("b", pcs["b"].LocalAddr().String(), bKey)
	pc2, err := net.ListenPacket("udp", hostOf(pcs["a"].LocalAddr().String())+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc2.Close() })
	next := start("a", a.m.NodeKey(), pc2, dir, nil)
	if got, err := ask(next); err != nil || got != want {
		t.Fatalf("a's next incarnation -> b while b's gossip records its leave: %q, %v; want %q (served)", got, err, want)
	}
	if refused.has("a/" + RefusedNotAdmitted) {
		t.Errorf("b refused a as not admitted: %v", refused.seen)
	}

	// Revoked, it is refused: its connection is cut and a new handshake fails.
	if err := b.m.Revoke("a"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "b refuses the revoked a", func() bool {
		_, err := ask(next)
		return err != nil
	})
	// Reported by a request on the old connection (if b's re-check has
	// not closed it yet) or by the handshake of a new one: ask until one
	// of them happened, since the error above may have been the close.
	eventually(t, 5*time.Second, "the refusal is reported", func() bool {
		if refused.has("a/" + RefusedNotAdmitted) {
			return true
		}
		_, _ = ask(next)
		return refused.has("a/" + RefusedNotAdmitted)
	})
}
