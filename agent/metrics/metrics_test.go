package metrics

import (
	"context"
	"errors"
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
func demo(t *testing.T) string {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model = "demo"
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
	if err := table.RegisterLocal("chat", placement.Local{Base: demo(t), Model: "demo"}); err != nil {
		t.Fatal(err)
	}
	if err := table.RegisterLocal("dead", placement.Local{Base: deadBase(t), Model: "demo"}); err != nil {
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

	code, body := post(t, "http://"+chat.String()+"/v1/chat/completions",
		`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if code != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream = %d %q", code, body)
	}
	code, _ = post(t, "http://"+chat.String()+"/v1/chat/completions",
		`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`)
	if code != 200 {
		t.Fatalf("non-stream = %d", code)
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
		{"requests chat/local/200", testutil.ToFloat64(m.requests.WithLabelValues("chat", "local", "200")), 2},
		{"requests dead/local/502", testutil.ToFloat64(m.requests.WithLabelValues("dead", "local", "502")), 1},
		{"requests empty/none/503", testutil.ToFloat64(m.requests.WithLabelValues("empty", "none", "503")), 1},
		{"requests chat/none/404", testutil.ToFloat64(m.requests.WithLabelValues("chat", "none", "404")), 1},
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
	// Both chat requests are in the duration and TTFT histograms.
	exp := scrape(t, m)
	for _, refused := range []string{`role="chat",target="none"`, `role="empty",target="none"`} {
		if c := "infermesh_request_duration_seconds_count{" + refused + "} "; strings.Contains(exp, c) && !strings.Contains(exp, c+"0\n") {
			t.Errorf("a refused request (%s) is in the latency histogram", refused)
		}
	}
	for _, want := range []string{
		`infermesh_request_duration_seconds_count{role="chat",target="local"} 2`,
		`infermesh_time_to_first_token_seconds_count{role="chat",target="local"} 2`,
		`infermesh_local_instances{role="chat"} 1`,
		`infermesh_build_info{version="test"} 1`,
		`infermesh_placement_generation `,
	} {
		if !strings.Contains(exp, want) {
			t.Errorf("exposition lacks %q", want)
		}
	}
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
		m.Done("chat", "local", 200, 40*time.Millisecond, 1234, false)
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
			m.Done("chat", "local", 200, 10*time.Millisecond, 100, false)
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
