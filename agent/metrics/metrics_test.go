package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newForTest(t *testing.T, src PlacementSource) *Metrics {
	t.Helper()
	m, err := New(Config{Version: "test", Placement: src, NoRuntimeCollectors: true})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// demo serves the demo model on loopback and returns its base URL.
func demo(t *testing.T, model string) string {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model = model
	srv, err := demomodel.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	return ts.URL
}

// deadBase is a loopback base nobody listens on.
func deadBase(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

func post(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestProxyObserved drives a real proxy in front of the demo model and checks
// what the collectors saw.
func TestProxyObserved(t *testing.T) {
	table, err := placement.New(placement.Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if err := table.RegisterLocal("chat", placement.Local{Base: demo(t, "demo"), Model: "demo"}); err != nil {
		t.Fatal(err)
	}
	if err := table.RegisterLocal("dead", placement.Local{Base: deadBase(t), Model: "demo"}); err != nil {
		t.Fatal(err)
	}
	// Not pinned: the body is relayed as it is, not rewritten.
	if err := table.RegisterLocal("raw", placement.Local{Base: demo(t, "raw")}); err != nil {
		t.Fatal(err)
	}
	m := newForTest(t, table)
	p, err := proxy.New(proxy.Config{Resolver: table, Observer: m, ConnectTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	chat, err := p.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead, err := p.Listen("dead", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	empty, err := p.Listen("empty", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := p.Listen("raw", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}

	// Every answer reports usage (the streams because they ask for it),
	// rewritten (chat) or relayed as it is (raw): 16 completion tokens
	// each, the demo model's default.
	for role, port := range map[string]net.Addr{"chat": chat, "raw": raw} {
		code, body := post(t, "http://"+port.String()+"/v1/chat/completions",
			`{"model":"`+role+`","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`)
		if code != 200 || !strings.Contains(body, "[DONE]") || !strings.Contains(body, `"completion_tokens":16`) {
			t.Fatalf("stream = %d %q", code, body)
		}
		code, body = post(t, "http://"+port.String()+"/v1/chat/completions",
			`{"model":"`+role+`","messages":[{"role":"user","content":"hi"}]}`)
		if code != 200 || !strings.Contains(body, `"completion_tokens":16`) {
			t.Fatalf("non-stream = %d %q", code, body)
		}
	}
	if code, _ := post(t, "http://"+dead.String()+"/v1/chat/completions", `{"model":"dead"}`); code != 502 {
		t.Fatalf("dead upstream = %d, want 502", code)
	}
	// Nothing serves the role: answered without an attempt, counted with
	// target "none".
	if code, _ := post(t, "http://"+empty.String()+"/v1/chat/completions", `{"model":"empty"}`); code != 503 {
		t.Fatalf("no instance = %d, want 503", code)
	}

	// Refused before any candidate: counted, but not in the latency.
	if code, _ := post(t, "http://"+chat.String()+"/v1/chat/completions", `{"model":"gpt-4o"}`); code != 404 {
		t.Fatalf("unknown model = %d, want 404", code)
	}
	counters := []struct {
		name string
		got  float64
		want float64
	}{
		{"requests chat/local/200", testutil.ToFloat64(m.requests.WithLabelValues("chat", "local", "app", "200")), 2},
		{"requests dead/local/502", testutil.ToFloat64(m.requests.WithLabelValues("dead", "local", "app", "502")), 1},
		{"requests empty/none/503", testutil.ToFloat64(m.requests.WithLabelValues("empty", "none", "app", "503")), 1},
		{"requests chat/none/404", testutil.ToFloat64(m.requests.WithLabelValues("chat", "none", "app", "404")), 1},
		{"completion tokens chat", testutil.ToFloat64(m.tokens.WithLabelValues("chat", "local", "app", "completion")), 32},
		{"completion tokens raw", testutil.ToFloat64(m.tokens.WithLabelValues("raw", "local", "app", "completion")), 32},
		{"attempts chat ok", testutil.ToFloat64(m.attempts.WithLabelValues("chat", "local", "ok")), 2},
		{"attempts dead error", testutil.ToFloat64(m.attempts.WithLabelValues("dead", "local", "error")), 1},
		{"failovers dead", testutil.ToFloat64(m.failovers.WithLabelValues("dead", "local")), 1},
		{"failovers chat", testutil.ToFloat64(m.failovers.WithLabelValues("chat", "local")), 0},
		{"active streams chat", testutil.ToFloat64(m.streams.WithLabelValues("chat")), 0},
	}
	for _, c := range counters {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if b := testutil.ToFloat64(m.bytes.WithLabelValues("chat", "local")); b <= 0 {
		t.Errorf("response bytes chat/local = %v, want > 0", b)
	}
	for _, role := range []string{"chat", "raw"} {
		if n := testutil.ToFloat64(m.tokens.WithLabelValues(role, "local", "app", "prompt")); n <= 0 {
			t.Errorf("prompt tokens %s = %v, want > 0", role, n)
		}
	}
	// Both chat requests are in the duration histogram, the stream alone
	// in the first-token one.
	exp := scrape(t, m)
	for _, refused := range []string{`role="chat",source="app",target="none"`, `role="empty",source="app",target="none"`} {
		if c := "infermesh_request_duration_seconds_count{" + refused + "} "; strings.Contains(exp, c) && !strings.Contains(exp, c+"0\n") {
			t.Errorf("a refused request (%s) is in the latency histogram", refused)
		}
	}
	for _, want := range []string{
		`infermesh_request_duration_seconds_count{role="chat",source="app",target="local"} 2`,
		`infermesh_time_to_first_token_seconds_count{role="chat",source="app",target="local"} 1`,
		`infermesh_time_to_first_token_seconds_count{role="raw",source="app",target="local"} 1`,
		`infermesh_local_instances{role="chat"} 1`,
		`infermesh_build_info{version="test"} 1`,
		`infermesh_placement_generation `,
	} {
		if !strings.Contains(exp, want) {
			t.Errorf("exposition lacks %q", want)
		}
	}
}

// TestFirstTokenIsTheFirstEvent: an instance sends its stream's headers at
// once and its first event only after the test saw the headers and waited
// gap; the first-token time covers the gap (headers alone would not).
func TestFirstTokenIsTheFirstEvent(t *testing.T) {
	const gap = 300 * time.Millisecond
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		http.NewResponseController(w).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n")
	}))
	t.Cleanup(up.Close)
	table, err := placement.New(placement.Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if err := table.RegisterLocal("chat", placement.Local{Base: up.URL}); err != nil {
		t.Fatal(err)
	}
	m := newForTest(t, table)
	p, err := proxy.New(proxy.Config{Resolver: table, Observer: m})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	addr, err := p.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+addr.String()+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	time.Sleep(gap) // the delay measured, after the headers arrived
	close(release)
	if b, _ := io.ReadAll(resp.Body); !strings.Contains(string(b), "[DONE]") {
		t.Fatalf("stream %q", b)
	}
	waitFor(t, func() bool { return testutil.CollectAndCount(m.ttft) == 1 })
	exp := scrape(t, m)
	const sum = `infermesh_time_to_first_token_seconds_sum{role="chat",source="app",target="local"} `
	i := strings.Index(exp, sum)
	if i < 0 {
		t.Fatalf("no first-token sum:\n%s", exp)
	}
	var got float64
	if _, err := fmt.Sscan(exp[i+len(sum):], &got); err != nil {
		t.Fatal(err)
	}
	if got < gap.Seconds() {
		t.Errorf("first token after %vs, want at least the %v between the headers and the first event", got, gap)
	}
}

// waitFor polls cond for up to a minute (a loaded machine).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, "the condition", time.Minute, cond)
}

func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 {
		t.Fatalf("GET /metrics = %d", rec.Code)
	}
	return rec.Body.String()
}

type fakeMesh struct{}

func (fakeMesh) PeerStates() map[string]int { return map[string]int{"admitted": 2, "not_admitted": 1} }
func (fakeMesh) Refusals() map[string]uint64 {
	return map[string]uint64{"bad_signature": 3}
}
func (fakeMesh) CertificateExpiry() (time.Time, bool) { return time.Unix(1_900_000_000, 0), true }
func (fakeMesh) PeerCertExpiries() map[string]time.Time {
	return map[string]time.Time{"b": time.Unix(1900000000, 0)}
}

func TestScrapeSources(t *testing.T) {
	now := time.Unix(1000, 0)
	table, err := placement.New(placement.Config{NodeID: "a", Admission: admitAll{}, Now: func() time.Time { return now }, AdvertTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	table.AllowRemoteNode("chat", "b", true)
	table.AllowRemoteNode("chat", "c", true)
	table.ExposeToMesh("chat", true)
	for _, n := range []string{"b", "c"} {
		if err := table.IngestAdvertisement(n, placement.Advert{Name: "infer.chat", Node: n, Model: "m"}); err != nil {
			t.Fatal(err)
		}
	}
	m := newForTest(t, table)
	m.Refused("node not allowlisted for role")
	exp := scrape(t, m)
	if strings.Contains(exp, "infermesh_peers") {
		t.Error("infermesh_peers present without a mesh")
	}
	m.SetMesh(fakeMesh{})
	exp = scrape(t, m)
	for _, want := range []string{
		`infermesh_adverts{role="chat",state="fresh"} 2`,
		`infermesh_adverts{role="chat",state="stale"} 0`,
		`infermesh_exposed_roles{role="chat"} 1`,
		`infermesh_peers{state="admitted"} 2`,
		`infermesh_peers{state="not_admitted"} 1`,
		`infermesh_mesh_refusals_total{reason="bad_signature"} 3`,
		`infermesh_certificate_expiry_timestamp_seconds 1.9e+09`,
		`infermesh_peer_certificate_expiry_timestamp_seconds{node="b"} 1.9e+09`,
		`infermesh_refusals_total{reason="node not allowlisted for role"} 1`,
	} {
		if !strings.Contains(exp, want) {
			t.Errorf("exposition lacks %q\n%s", want, exp)
		}
	}
	now = now.Add(2 * time.Minute)
	if exp := scrape(t, m); !strings.Contains(exp, `infermesh_adverts{role="chat",state="stale"} 2`) {
		t.Error("expired adverts not reported stale")
	}
}

type admitAll struct{}

func (admitAll) IsAdmitted(string) bool { return true }
func (admitAll) MayServe(string) bool   { return true }
func (admitAll) Trusted(string) bool    { return true }

// TestObserverAllocations: once a label set was seen, the request path
// allocates nothing in the collectors.
func TestObserverAllocations(t *testing.T) {
	m := newForTest(t, nil)
	errDial := errors.New("dial")
	path := func() {
		m.Attempt("chat", "b", 0, errDial, time.Millisecond)
		m.Attempt("chat", "local", 200, nil, 3*time.Millisecond)
		m.StreamOpen("chat")
		m.StreamClose("chat")
		m.Done(proxy.Outcome{Role: "chat", Target: "local", Source: "app", Status: 200, Duration: 40 * time.Millisecond,
			FirstEvent: 5 * time.Millisecond, Bytes: 1234, Usage: true, PromptTokens: 3, CompletionTokens: 16})
	}
	path()
	if n := testing.AllocsPerRun(200, path); n != 0 {
		t.Errorf("allocations per request = %v, want 0", n)
	}
}

func BenchmarkObserver(b *testing.B) {
	m, err := New(Config{NoRuntimeCollectors: true})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.Attempt("chat", "local", 200, nil, time.Millisecond)
			m.Done(proxy.Outcome{Role: "chat", Target: "local", Source: "app", Status: 200, Duration: 10 * time.Millisecond, Bytes: 100})
		}
	})
}

type fakeInstances []InstanceStat

func (f fakeInstances) InstanceStats() []InstanceStat { return f }

func TestInstanceMetrics(t *testing.T) {
	m := newForTest(t, nil)
	if exp := scrape(t, m); strings.Contains(exp, "infermesh_instance_state") {
		t.Errorf("instance series without instances:\n%s", exp)
	}
	m.SetInstances(fakeInstances{{Role: "chat", State: "ready", Restarts: 2}, {Role: "embed", State: "pulling"}})
	exp := scrape(t, m)
	for _, want := range []string{
		`infermesh_instance_state{role="chat",state="ready"} 1`,
		`infermesh_instance_state{role="embed",state="pulling"} 1`,
		`infermesh_instance_restarts_total{role="chat"} 2`,
		`infermesh_instance_restarts_total{role="embed"} 0`,
	} {
		if !strings.Contains(exp, want) {
			t.Errorf("exposition lacks %q", want)
		}
	}
}
