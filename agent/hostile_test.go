package agent

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quic-go/qpack"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"github.com/quic-go/quic-go/quicvarint"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/proxy"
)

// What an admitted peer can do to another that its agent never would:
// the tests here speak to a real agent as a node holding an admitted key,
// straight from quic-go (hostileClient), or serve a real agent from a
// peer whose QUIC handler misbehaves, or from an instance that does.

// startProc runs n (a testMesh node in tm.procs) as an infermeshd process
// from its config file, and waits until its role ports answer.
func (tm *testMesh) startProc(n *meshNode) *meshNode {
	t := tm.t.(*testing.T)
	t.Helper()
	n.proc = startAgentProc(t, staticBins(t)["infermeshd"], n.cfgPath)
	for role, port := range n.ports {
		testproc.WaitUntil(t, n.name+" serving "+role, 60*time.Second, func() bool {
			if n.proc.cmd.ProcessState != nil {
				t.Fatalf("%s exited", n.name)
			}
			return testproc.Healthy(port)
		})
	}
	return n
}

// adminClient is a client of n's admin socket.
func (n *meshNode) adminClient(t *testing.T) *admin.Client {
	c := admin.NewClient(filepath.Join(n.stateDir, "admin.sock"), admin.ClientOptions{Wait: 10 * time.Second})
	t.Cleanup(c.Close)
	return c
}

// procAdmits waits until n (a process) admits peer.
func (n *meshNode) procAdmits(t *testing.T, c *admin.Client, peer string) {
	t.Helper()
	testproc.WaitUntil(t, n.name+" admits "+peer, 60*time.Second, func() bool {
		ps, err := c.Peers(context.Background())
		if err != nil {
			return false
		}
		for _, p := range ps {
			if p.Name == peer && p.State == "admitted" {
				return true
			}
		}
		return false
	})
}

// events returns n's recent audit events of kind.
func (n *meshNode) events(t *testing.T, c *admin.Client, kind string) []admin.Event {
	t.Helper()
	var out []admin.Event
	if err := c.Events(context.Background(), admin.EventsOptions{}, func(e admin.Event) error {
		if e.Kind == kind {
			out = append(out, e)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// hostileClient speaks HTTP/3 to a node's QUIC transport straight from
// quic-go, presenting the key of an admitted node (read from its state
// dir): it opens as many connections and streams as it likes, and sends
// whatever it likes on them.
type hostileClient struct {
	t    *testing.T
	cert tls.Certificate
	addr string
}

func newHostileClient(t *testing.T, as, to *meshNode) *hostileClient {
	t.Helper()
	key, err := identity.LoadKey(filepath.Join(as.stateDir, identity.NodeKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	return &hostileClient{t: t, cert: selfSigned(t, as.name, key), addr: to.quic}
}

// dial opens a new QUIC connection, on a socket of its own, with an
// HTTP/3 client on it; it is closed at cleanup.
func (h *hostileClient) dial(ctx context.Context) *http3.ClientConn {
	h.t.Helper()
	tc := &tls.Config{Certificates: []tls.Certificate{h.cert}, InsecureSkipVerify: true,
		NextProtos: []string{http3.NextProtoH3}, MinVersion: tls.VersionTLS13}
	conn, err := quic.DialAddr(ctx, h.addr, tc, &quic.Config{KeepAlivePeriod: 200 * time.Millisecond, MaxIncomingStreams: -1})
	if err != nil {
		h.t.Fatalf("dialing %s: %v", h.addr, err)
	}
	h.t.Cleanup(func() { _ = conn.CloseWithError(0, "") })
	return (&http3.Transport{}).NewClientConn(conn)
}

// hopRequest is a request for role as an agent sends it over the hop.
func hopRequest(ctx context.Context, node, role, path string, body io.Reader) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+node+path, body)
	req.Header.Set(proxy.RoleHeader, role)
	req.Header.Set("Content-Type", "application/json")
	return req
}

const hiBody = `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`

// probe asks the node's liveness probe on cc: the transport answers it
// itself, whatever its limits.
func probe(ctx context.Context, cc *http3.ClientConn, node string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+node+"/.well-known/infermesh/alive", nil)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("probe answered %s", resp.Status)
	}
	return nil
}

// holdingInstance is an OpenAI-compatible instance that holds every
// request until released, counting those it holds.
type holdingInstance struct {
	base           string
	release        chan struct{}
	once           sync.Once
	inFlight, peak atomic.Int64
	served         atomic.Int64
}

// unblock answers every request held and every one to come.
func (h *holdingInstance) unblock() { h.once.Do(func() { close(h.release) }) }

func startHoldingInstance(t *testing.T) *holdingInstance {
	t.Helper()
	h := &holdingInstance{release: make(chan struct{})}
	srv := startInstance(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // health probes
		}
		_, _ = io.Copy(io.Discard, r.Body)
		n := h.inFlight.Add(1)
		for p := h.peak.Load(); n > p && !h.peak.CompareAndSwap(p, n); p = h.peak.Load() {
		}
		defer h.inFlight.Add(-1)
		select {
		case <-h.release:
		case <-r.Context().Done():
			return
		}
		h.served.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"1","object":"chat.completion","model":"m","choices":[]}`)
	}))
	h.base = srv
	t.Cleanup(h.unblock)
	return h
}

// startInstance serves h on a loopback port until cleanup; it returns
// the base URL.
func startInstance(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close(); <-done })
	return "http://" + ln.Addr().String()
}

// TestPeerBoundsHoldPerNodeAcrossConnections: a node holding an admitted
// key opens five QUIC connections to b and 16 requests on each, where b
// allows 16 in flight per peer (mesh.max_streams_per_peer) and 4
// connections (the default mesh.max_conns_per_peer). b is a real
// infermeshd process. Its instance never holds more than 16 of the
// node's requests at once, its descriptors grow by no more than those
// 16 requests need, the fifth connection is closed, and each refusal is
// audited once, however many streams it refused (and counted for every
// one). Before, each connection had its own 16 and nothing bounded the
// connections: 80 requests reached the instance.
func TestPeerBoundsHoldPerNodeAcrossConnections(t *testing.T) {
	const streams, conns = 16, 5
	tm := newTestMesh(t, "a", "b")
	tm.procs = map[string]bool{"b": true}
	tm.meshYAML = map[string]string{"b": fmt.Sprintf("  max_streams_per_peer: %d\n", streams)}
	inst := startHoldingInstance(t)
	tm.start("a", map[string]roleSpec{"other": {}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: &testUpstream{base: inst.base}, model: "m", expose: true, serveTo: []string{"a"}}}, false)
	bc := b.adminClient(t)
	b.procAdmits(t, bc, "a")
	pid := b.proc.cmd.Process.Pid
	fdsBefore := testproc.OpenFDs(t, pid)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	h := newHostileClient(t, tm.nodes["a"], b)
	var open []*http3.ClientConn
	refusedConns := 0
	for i := range conns {
		cc := h.dial(ctx)
		// Nothing but the test's own connections come from a's key: a
		// sends b no requests (it does not accept chat from b).
		if err := probe(ctx, cc, "b"); err != nil {
			t.Logf("connection %d: %v", i+1, err)
			refusedConns++
			continue
		}
		open = append(open, cc)
	}
	if len(open) != 4 || refusedConns != 1 {
		t.Errorf("%d of %d connections from one key were served, %d refused; want 4 served (mesh.max_conns_per_peer) and 1 refused", len(open), conns, refusedConns)
	}

	// Each connection allows 16 streams: none of these waits for one.
	var busy, other atomic.Int64
	var wg sync.WaitGroup
	defer func() { inst.unblock(); wg.Wait() }() // also when the test fails early
	for _, cc := range open {
		for range streams {
			wg.Go(func() {
				resp, err := cc.RoundTrip(hopRequest(ctx, "b", "chat", "/v1/chat/completions", strings.NewReader(hiBody)))
				if err != nil {
					other.Add(1)
					return
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode == http.StatusServiceUnavailable && bytes.Contains(body, []byte(`"too_many_streams"`)) && resp.Header.Get("Retry-After") != "":
					busy.Add(1)
				case resp.StatusCode == http.StatusOK:
				default:
					t.Errorf("status %d %s", resp.StatusCode, body)
				}
			})
		}
	}
	total := int64(len(open) * streams)
	testproc.WaitUntil(t, "the requests over the bound refused and the rest at the instance", 60*time.Second, func() bool {
		return busy.Load()+other.Load() >= total-streams && inst.inFlight.Load() >= streams || inst.peak.Load() > streams
	})
	fdsDuring := testproc.OpenFDs(t, pid)
	peak := inst.peak.Load()
	inst.unblock()
	wg.Wait()

	if peak != streams {
		t.Errorf("b's instance held %d of the node's requests at once, want %d (mesh.max_streams_per_peer across all its connections)", peak, streams)
	}
	if got := busy.Load(); got != total-streams || other.Load() != 0 {
		t.Errorf("%d requests answered 503 too_many_streams and %d failed otherwise; want %d and 0", got, other.Load(), total-streams)
	}
	// A held request costs b its instance connection; 16 more spare for
	// the runtime and the instance's health probes.
	if grew := fdsDuring - fdsBefore; grew > streams+16 {
		t.Errorf("b's open descriptors grew by %d (%d -> %d) under the node's requests, want at most %d", grew, fdsBefore, fdsDuring, streams+16)
	}
	if got := inst.served.Load(); got != streams {
		t.Errorf("b's instance answered %d requests, want the %d it held", got, streams)
	}
	for why, want := range map[string]int{"too_many_streams": 1, "too_many_connections": 1} {
		var n int
		for _, e := range b.events(t, bc, "mesh.quic.refused") {
			if e.Node == "a" && e.Fields["why"] == why {
				n++
			}
		}
		if n != want {
			t.Errorf("b audited %d %s refusals of a, want %d (once, not per stream)", n, why, want)
		}
	}
	metrics, err := bc.Metrics(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`reason="quic_too_many_streams"} %d`, total-streams); !strings.Contains(metrics, want) {
		t.Errorf("b's metrics do not count every refused stream (%s)", want)
	}
	t.Logf("b's descriptors: %d before, %d with %d requests held; peak at the instance %d", fdsBefore, fdsDuring, streams, peak)
}

// TestPeerBodyTimeout: a node holding an admitted key sends b 20 requests
// whose bodies trickle in a byte every 200 ms and never end. b answers
// each 408 once proxy.body_timeout (1 s here) has passed, and closes the
// stream (the sender's writes then fail); its instance sees none. Before,
// nothing bounded a body on the hop: the requests were held as long as
// the sender liked.
func TestPeerBodyTimeout(t *testing.T) {
	const n = 20
	tm := newTestMesh(t, "a", "b")
	tm.proxyYAML = map[string]string{"b": "body_timeout: 1s, "}
	ub := startUpstream(t, "model-b", 0)
	tm.start("a", map[string]roleSpec{"other": {}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "b admits a", func() bool { return b.agent.Mesh().IsAdmitted("a") })

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc := newHostileClient(t, tm.nodes["a"], b).dial(ctx)
	type result struct {
		status int
		body   string
		err    error
	}
	results := make(chan result, n)
	writeErrs := make(chan error, n)
	for range n {
		pr, pw := io.Pipe()
		context.AfterFunc(ctx, func() { pw.CloseWithError(ctx.Err()) })
		go func() {
			// One byte every 200 ms until the stream is closed under it.
			defer pr.Close()
			_, _ = pw.Write([]byte(`{"model":"chat","messages":[`))
			tick := time.NewTicker(200 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					writeErrs <- ctx.Err()
					return
				case <-tick.C:
				}
				if _, err := pw.Write([]byte(" ")); err != nil {
					writeErrs <- err
					return
				}
			}
		}()
		go func() {
			resp, err := cc.RoundTrip(hopRequest(ctx, "b", "chat", "/v1/chat/completions", pr))
			if err != nil {
				results <- result{err: err}
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			results <- result{status: resp.StatusCode, body: string(body)}
		}()
	}
	for range n {
		r := <-results
		if r.err != nil || r.status != http.StatusRequestTimeout || !strings.Contains(r.body, `"request_timeout"`) {
			t.Errorf("a trickling body: %d %s (%v); want 408 request_timeout", r.status, r.body, r.err)
		}
	}
	for range n {
		if err := <-writeErrs; errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("a sender could write until the test's deadline: the stream was not closed after the 408")
		}
	}
	if got := ub.requests.Load(); got != 0 {
		t.Errorf("b's instance saw %d requests, want 0", got)
	}
}

// recordingInstance is the demo model behind a server that keeps every
// request's header and query.
type recordingInstance struct {
	*testUpstream
	mu      sync.Mutex
	headers []http.Header
	queries []string
}

func startRecordingInstance(t *testing.T, model string) *recordingInstance {
	t.Helper()
	demo := startUpstream(t, model, 0) // for its demo model
	ri := &recordingInstance{}
	base := startInstance(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			ri.mu.Lock()
			ri.headers = append(ri.headers, r.Header.Clone())
			ri.queries = append(ri.queries, r.URL.RawQuery)
			ri.mu.Unlock()
		}
		demo.demo.ServeHTTP(w, r)
	}))
	ri.testUpstream = &testUpstream{base: base}
	return ri
}

func (ri *recordingInstance) last() (http.Header, string, int) {
	ri.mu.Lock()
	defer ri.mu.Unlock()
	if len(ri.headers) == 0 {
		return nil, "", 0
	}
	return ri.headers[len(ri.headers)-1], ri.queries[len(ri.queries)-1], len(ri.headers)
}

// TestServingSideAppliesTheMeshAllowlist: an admitted peer sends b's agent
// Authorization, Cookie, X-Forwarded-For and a ?debug=1 query over QUIC;
// b's instance sees none of them (b applies proxy.MeshHeaders itself and
// drops the query). And an app's query on a remote role does not cross
// the hop either. Before, b passed whatever the peer sent.
func TestServingSideAppliesTheMeshAllowlist(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ri := startRecordingInstance(t, "model-b")
	a, b := tm.chatFromB(ri.testUpstream)
	tm.admitEachOther("a", "b")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	check := func(how string, wantSeen int, keep ...string) {
		t.Helper()
		h, q, seen := ri.last()
		if seen != wantSeen {
			t.Fatalf("%s: b's instance saw %d requests, want %d", how, seen, wantSeen)
		}
		for _, k := range []string{"Authorization", "Cookie", "X-Forwarded-For", proxy.RoleHeader} {
			if v := h.Get(k); v != "" {
				t.Errorf("%s: b's instance got %s %q", how, k, v)
			}
		}
		if q != "" {
			t.Errorf("%s: b's instance got the query %q", how, q)
		}
		for _, k := range keep {
			if h.Get(k) == "" {
				t.Errorf("%s: %s (in proxy.MeshHeaders) did not reach b's instance", how, k)
			}
		}
	}

	cc := newHostileClient(t, a, b).dial(ctx)
	req := hopRequest(ctx, "b", "chat", "/v1/chat/completions?debug=1", strings.NewReader(hiBody))
	req.Header.Set("Authorization", "Bearer sk-peer-secret")
	req.Header.Set("Cookie", "session=peer")
	req.Header.Set("X-Forwarded-For", "203.0.113.7")
	req.Header.Set("Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	sendOK(t, "the peer's request", cc.RoundTrip, req)
	check("a peer's request over QUIC", 1, "Traceparent")

	app, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions?debug=1", strings.NewReader(hiBody))
	app.Header.Set("Cookie", "session=app")
	app.Header.Set("Authorization", "Bearer sk-app")
	sendOK(t, "the app's request", http.DefaultClient.Do, app)
	check("an app's request through a", 2)
}

// sendOK sends req with do and reads its answer, which must be 200.
func sendOK(t *testing.T, what string, do func(*http.Request) (*http.Response, error), req *http.Request) {
	t.Helper()
	resp, err := do(req)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: status %d", what, resp.StatusCode)
	}
}

// hostileHandler makes name's QUIC transport serve peers' requests with h
// instead of the agent's proxy; the transport itself (admission, bounds,
// the liveness probe) still runs.
func (tm *testMesh) hostileHandler(name string, h http.HandlerFunc) {
	prev := tm.transportTuning
	tm.transportTuning = func(n string, c *mesh.TransportConfig) {
		if prev != nil {
			prev(n, c)
		}
		if n == name {
			c.Handler = h
		}
	}
}

// TestRemotePeerWithoutHeadersIsLeftAtUpstreamTimeout: b answers the
// liveness probe (its transport does) but never sends response headers.
// a bounds the whole wait for b's headers by proxy.upstream_timeout (2 s
// here), as it bounds a local instance's: then b counts as failed and c,
// which serves the role too, answers the app. With c gone as well, the app
// gets 504. Before, the request waited on b for as long as b liked.
func TestRemotePeerWithoutHeadersIsLeftAtUpstreamTimeout(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	tm.proxyYAML = map[string]string{"a": "upstream_timeout: 2s, "}
	var held atomic.Int64
	tm.hostileHandler("b", func(w http.ResponseWriter, r *http.Request) {
		held.Add(1)
		<-r.Context().Done() // never a header
	})
	ub := startUpstream(t, "model-b", 0)
	uc := startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })
	tm.admitEachOther("a", "b", "c")

	client := &http.Client{Timeout: 30 * time.Second}
	post := func() (*http.Response, string) {
		t.Helper()
		resp, err := client.Post(a.url("chat")+"/v1/chat/completions", "application/json", strings.NewReader(hiBody))
		if err != nil {
			t.Fatalf("the app's request: %v (b held it)", err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(body)
	}
	// b and c are equal: b (the lower id) is tried first.
	resp, body := post()
	if resp.StatusCode != http.StatusOK || resp.Header.Get(proxy.ServedByHeader) != "c" {
		t.Fatalf("status %d served by %q: %s; want 200 from c", resp.StatusCode, resp.Header.Get(proxy.ServedByHeader), body)
	}
	if held.Load() != 1 || uc.requests.Load() != 1 {
		t.Fatalf("b held %d requests, c served %d; want b tried first, then c", held.Load(), uc.requests.Load())
	}
	failed := false
	for _, p := range a.agent.PeerScores() {
		failed = failed || (p.Node == "b" && p.Failures > 0)
	}
	if !failed {
		t.Errorf("a's view of its peers %+v: want b's failure counted", a.agent.PeerScores())
	}

	tm.stop("c")
	waitFor(t, "a resolves chat to b alone", func() bool { return a.resolvesTo("chat", "b") })
	resp, body = post()
	if resp.StatusCode != http.StatusGatewayTimeout || !strings.Contains(body, `"upstream_timeout"`) {
		t.Errorf("with b alone: %d %s; want 504 upstream_timeout", resp.StatusCode, body)
	}
}

// startRawPeer serves node n's QUIC endpoint from the test instead of its
// agent: a quic-go server presenting n's key that answers each HTTP/3
// request (its path, from the request's HEADERS frame) with whatever
// answer writes on the stream. It speaks HTTP/3 no further than that and
// its SETTINGS. It returns the address to advertise
// (mesh.quic_advertise), where peers then reach it as n.
func startRawPeer(t *testing.T, n *meshNode, answer func(str *quic.Stream, path string)) string {
	t.Helper()
	key, err := identity.LoadKey(filepath.Join(n.stateDir, identity.NodeKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	tc := &tls.Config{Certificates: []tls.Certificate{selfSigned(t, n.name, key)},
		NextProtos: []string{http3.NextProtoH3}, MinVersion: tls.VersionTLS13}
	ln, err := quic.ListenAddr(n.ip+":0", tc, &quic.Config{KeepAlivePeriod: 200 * time.Millisecond, MaxIncomingStreams: 1000})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept(ctx)
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.CloseWithError(0, "")
				ctrl, err := c.OpenUniStream()
				if err != nil {
					return
				}
				_, _ = ctrl.Write([]byte{0x00, 0x04, 0x00}) // a control stream: an empty SETTINGS frame
				for {
					str, err := c.AcceptStream(ctx)
					if err != nil {
						return
					}
					wg.Go(func() {
						defer str.CancelRead(0)
						defer str.Close()
						br := bufio.NewReader(str)
						typ, err1 := quicvarint.Read(br)
						n, err2 := quicvarint.Read(br)
						if err1 != nil || err2 != nil || typ != 0x01 || n > 64<<10 {
							return
						}
						block := make([]byte, n)
						if _, err := io.ReadFull(br, block); err != nil {
							return
						}
						path := ""
						for dec := qpack.NewDecoder().Decode(block); ; {
							f, err := dec()
							if err != nil {
								break
							}
							if f.Name == ":path" {
								path = f.Value
							}
						}
						answer(str, path)
					})
				}
			})
		}
	})
	t.Cleanup(func() { cancel(); ln.Close(); wg.Wait() })
	return ln.Addr().String()
}

// headersFrame is an HTTP/3 HEADERS frame of fields.
func headersFrame(t *testing.T, fields ...qpack.HeaderField) []byte {
	t.Helper()
	var block bytes.Buffer
	enc := qpack.NewEncoder(&block)
	for _, f := range fields {
		if err := enc.WriteField(f); err != nil {
			t.Fatal(err)
		}
	}
	frame := quicvarint.Append(quicvarint.Append(nil, 0x01), uint64(block.Len()))
	return append(frame, block.Bytes()...)
}

// TestRemotePeerHugeResponseHeadIsRefused: b answers every request with
// 9 MiB of response headers, 40 at once, to a, a real infermeshd process.
// a refuses each head over 64 KiB, answers the app a clear 502, counts b's
// failure, and its peak RSS stays small. Before, a took up to quic-go's
// 10 MB per head: 40 of them took a from about 100 MiB to over 1 GiB, and
// the headers reached the app.
func TestRemotePeerHugeResponseHeadIsRefused(t *testing.T) {
	const parallel, headMiB = 40, 9
	tm := newTestMesh(t, "a", "b")
	tm.procs = map[string]bool{"a": true}
	fields := []qpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/json"}}
	for i := range headMiB {
		fields = append(fields, qpack.HeaderField{Name: fmt.Sprintf("x-huge-%d", i), Value: strings.Repeat("h", 1<<20)})
	}
	huge := headersFrame(t, fields...)
	alive := headersFrame(t, qpack.HeaderField{Name: ":status", Value: "204"})
	var asked atomic.Int64
	raw := startRawPeer(t, tm.nodes["b"], func(str *quic.Stream, path string) {
		if path == "/.well-known/infermesh/alive" {
			_, _ = str.Write(alive)
			return
		}
		asked.Add(1)
		_, _ = str.Write(huge) // fails once a gave up on the stream
	})
	tm.meshYAML = map[string]string{"b": "  quic_advertise: " + raw + "\n"}
	ub := startUpstream(t, "model-b", 0)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	ac := a.adminClient(t)
	testproc.WaitUntil(t, "a resolves chat to b", 60*time.Second, func() bool {
		rt, err := ac.Route(context.Background(), "chat")
		return err == nil && rt.Serving == "b"
	})
	pid := a.proc.cmd.Process.Pid
	before := testproc.MemKB(t, pid, "VmRSS")

	url := fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", a.ports["chat"])
	client := &http.Client{Timeout: 60 * time.Second}
	var wg sync.WaitGroup
	var headerBytes atomic.Int64
	for range parallel {
		wg.Go(func() {
			resp, err := client.Post(url, "application/json", strings.NewReader(hiBody))
			if err != nil {
				t.Error(err)
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for k, vv := range resp.Header {
				for _, v := range vv {
					headerBytes.Add(int64(len(k) + len(v)))
				}
			}
			if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "64 KiB") {
				t.Errorf("status %d %s; want 502 naming the 64 KiB limit", resp.StatusCode, body)
			}
		})
	}
	wg.Wait()
	peak := testproc.MemKB(t, pid, "VmHWM")
	t.Logf("a's RSS: %d MiB before, peak %d MiB after %d heads of %d MiB (%d asked)", before>>10, peak>>10, parallel, headMiB, asked.Load())
	if asked.Load() < parallel {
		t.Errorf("b was asked %d times, want %d", asked.Load(), parallel)
	}
	// One 9 MiB head held whole would be over this: a reads at most
	// 64 KiB of each.
	if peak-before > 64<<10 {
		t.Errorf("a's peak RSS %d MiB, %d MiB over its %d MiB before: heads were taken in", peak>>10, (peak-before)>>10, before>>10)
	}
	if got := headerBytes.Load(); got > 64<<10 {
		t.Errorf("%d bytes of headers reached the app", got)
	}
	rt, err := ac.Route(context.Background(), "chat")
	if err != nil {
		t.Fatal(err)
	}
	if len(rt.Decisions) == 0 || !strings.Contains(strings.Join(rt.Decisions[0].Notes, "; "), "failure") {
		t.Errorf("a's route for chat %+v: want b's failures noted", rt.Decisions)
	}
}

// TestPinnedHugeAnswersKeepTheServingAgentSmall: b's instance answers
// every request with 200 MiB of JSON, its model pinned (b rewrites it to
// the name asked for), and a peer asks for six at once and reads the
// first 16 MiB of each (enough to see each stream, rewritten, while all
// six are open; the rewrite of a whole large answer is
// TestPinnedLargeAnswerIsRewrittenAsItStreams's). b, a real infermeshd
// process, rewrites each as it streams: its peak RSS stays below what one
// such answer would take to hold. Before, b read each whole into memory
// before sending a byte: six took it past 1.2 GiB.
func TestPinnedHugeAnswersKeepTheServingAgentSmall(t *testing.T) {
	const parallel, size, read = 6, 200 << 20, 16 << 20
	tm := newTestMesh(t, "a", "b")
	tm.procs = map[string]bool{"b": true}
	head := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"model-b","choices":[{"index":0,"message":{"role":"assistant","content":"`)
	tail := []byte(`"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":7}}`)
	filler := bytes.Repeat([]byte("tokens \\\"and\\\" more {tokens} "), 1<<15)
	var started atomic.Int64
	base := startInstance(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		started.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(size))
		if _, err := w.Write(head); err != nil {
			return
		}
		for left := size - len(head) - len(tail); left > 0; {
			n := min(left, len(filler))
			if _, err := w.Write(filler[:n]); err != nil {
				return
			}
			left -= n
		}
		_, _ = w.Write(tail)
	}))
	tm.start("a", map[string]roleSpec{"other": {}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: &testUpstream{base: base}, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	bc := b.adminClient(t)
	b.procAdmits(t, bc, "a")
	pid := b.proc.cmd.Process.Pid
	before := testproc.MemKB(t, pid, "VmRSS")

	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cc := newHostileClient(t, tm.nodes["a"], b).dial(ctx)
	var wg sync.WaitGroup
	for range parallel {
		wg.Go(func() {
			resp, err := cc.RoundTrip(hopRequest(ctx, "b", "chat", "/v1/chat/completions", strings.NewReader(hiBody)))
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			start := make([]byte, 256)
			if _, err := io.ReadFull(resp.Body, start); err != nil || resp.StatusCode != http.StatusOK {
				t.Errorf("status %d, %v", resp.StatusCode, err)
				return
			}
			if !bytes.Contains(start, []byte(`"model":"chat"`)) {
				t.Errorf("the answer starts %q: want its model rewritten to chat", start)
			}
			if n, err := io.CopyN(io.Discard, resp.Body, read); n != read {
				t.Errorf("read %d bytes of the answer: %v", n, err)
			}
		})
	}
	wg.Wait()
	peak := testproc.MemKB(t, pid, "VmHWM")
	t.Logf("b's RSS: %d MiB before, peak %d MiB with %d answers of %d MiB streaming (%d MiB of each read)", before>>10, peak>>10, parallel, size>>20, read>>20)
	if started.Load() != parallel {
		t.Errorf("the instance started %d answers, want %d", started.Load(), parallel)
	}
	// 128 MiB is well below one answer held whole (200 MiB); streaming,
	// b holds a few flow-control windows per answer.
	if peak-before > 128<<10 {
		t.Errorf("b's peak RSS %d MiB is %d MiB over its %d MiB before: answers were held in memory", peak>>10, (peak-before)>>10, before>>10)
	}
}

// TestAgentHeadersComeFromTheAgent: the Infermesh-* headers and the
// X-Request-Id an app sees are the agent's, from what it knows: the node
// its peer's connection was verified as, and the request's id as it made
// or took it. A peer's own (hostile: Infermesh-Served-By: someone-else,
// X-Request-Id: forged-id, a cookie) and an instance's are dropped, and
// of a peer's other headers only proxy.PeerResponseHeaders pass; a's
// access log names b. Before, the forged ones reached the app and the log.
func TestAgentHeadersComeFromTheAgent(t *testing.T) {
	forge := func(h http.Header) {
		h.Set(proxy.ServedByHeader, "someone-else")
		h.Set(proxy.RequestIDHeader, "forged-id")
		h.Set("Infermesh-Load", "0")
		h.Set("Set-Cookie", "session=peer; Path=/")
		h.Set("X-Ratelimit-Remaining-Requests", "41")
		h.Set("Content-Type", "application/json")
	}
	check := func(t *testing.T, url string, servedBy string, peer bool) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(hiBody))
		req.Header.Set(proxy.RequestIDHeader, "app-trace-7")
		resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := resp.Header.Values(proxy.ServedByHeader); len(got) != 1 || got[0] != servedBy {
			t.Errorf("%s = %q, want [%s]", proxy.ServedByHeader, got, servedBy)
		}
		if got := resp.Header.Values(proxy.RequestIDHeader); len(got) != 1 || got[0] != "app-trace-7" {
			t.Errorf("%s = %q, want the app's [app-trace-7]", proxy.RequestIDHeader, got)
		}
		if got := resp.Header.Get("Infermesh-Load"); got != "" {
			t.Errorf("Infermesh-Load %q reached the app", got)
		}
		if got := resp.Header.Get("X-Ratelimit-Remaining-Requests"); got != "41" {
			t.Errorf("X-Ratelimit-Remaining-Requests = %q, want 41 passed", got)
		}
		if got := resp.Header.Get("Set-Cookie"); peer && got != "" {
			t.Errorf("a peer's Set-Cookie %q reached the app", got)
		}
	}

	t.Run("hostile peer", func(t *testing.T) {
		tm := newTestMesh(t, "a", "b")
		core, logs := observer.New(zap.InfoLevel)
		tm.loggers = map[string]*zap.Logger{"a": zap.New(core)}
		tm.hostileHandler("b", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			forge(w.Header())
			_, _ = io.WriteString(w, `{"id":"1","object":"chat.completion","model":"chat","choices":[]}`)
		})
		ub := startUpstream(t, "model-b", 0)
		a, _ := tm.chatFromB(ub)
		tm.admitEachOther("a", "b")
		check(t, a.url("chat"), "b", true)
		var servedBy []string
		for _, e := range logs.FilterLoggerName("access").FilterMessage("request").All() {
			servedBy = append(servedBy, e.ContextMap()["served_by"].(string))
		}
		if len(servedBy) != 1 || servedBy[0] != "b" {
			t.Errorf("a's access log served_by = %q, want [b]", servedBy)
		}
	})
	t.Run("hostile instance", func(t *testing.T) {
		tm := newTestMesh(t, "a", "b")
		demo := startUpstream(t, "model-b", 0)
		base := startInstance(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				forge(w.Header())
			}
			demo.demo.ServeHTTP(w, r)
		}))
		a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
		b := tm.start("b", map[string]roleSpec{"chat": {upstream: &testUpstream{base: base}, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
		waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
		tm.admitEachOther("a", "b")
		check(t, a.url("chat"), "b", true)  // over the hop
		check(t, b.url("chat"), "b", false) // b's own port: the local path
	})
}
