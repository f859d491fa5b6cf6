package agent

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/infermesh/infermesh/mesh"
)

// BenchmarkRemoteHop measures, in one run, a small non-streaming chat
// completion against the demo model four ways:
//
//	direct  client -> instance
//	local   client -> agent a -> instance (a's local role)
//	remote  client -> agent a -> QUIC -> agent b -> instance
//	h3      a bare HTTP/3 exchange between two mesh transports (the floor
//	        of the remote hop)
//
// at c=1 (p50/p99 latency) and c=64 (throughput). All share one instance.
// The remote path's target: remote - direct <= 1.25 x ((local - direct) + h3).
//
//	go test -run '^$' -bench RemoteHop -benchtime 2s -count 3 ./agent/
func BenchmarkRemoteHop(b *testing.B) {
	up := startUpstream(b, "demo", 0)
	tm := newTestMesh(b, "a", "b")
	na := tm.start("a", map[string]roleSpec{
		"chat":  {acceptFrom: []string{"b"}},
		"local": {upstream: up, model: "demo"},
	}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: up, model: "demo", expose: true, serveTo: []string{"a"}}}, false)
	eventuallyTB(b, "a resolves chat to b", func() bool { return na.resolvesTo("chat", "b") })
	eventuallyTB(b, "a's local instance is up", func() bool { return len(na.agent.Table().Resolve("local")) == 1 })

	h3 := newBareH3(b)
	type path struct {
		name string
		do   func() error
	}
	body := func(model string) []byte {
		return []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	}
	paths := []path{
		{"direct", httpPath(up.base, body("demo"))},
		{"local", httpPath(na.url("local"), body("local"))},
		{"remote", httpPath(na.url("chat"), body("chat"))},
		{"h3", h3.do},
	}
	for _, p := range paths { // warm every connection pool
		for range 64 {
			if err := p.do(); err != nil {
				b.Fatalf("%s: %v", p.name, err)
			}
		}
	}
	for _, p := range paths {
		b.Run(p.name+"/c=1", func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if err := p.do(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
	for _, p := range paths {
		b.Run(p.name+"/c=64", func(b *testing.B) {
			b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0)))
			t0 := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := p.do(); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(t0).Seconds(), "req/s")
		})
	}
}

// httpPath posts body to base's chat endpoint over HTTP/1.1 keep-alive.
func httpPath(base string, body []byte) func() error {
	client := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 256, DisableCompression: true}}
	url := base + "/v1/chat/completions"
	return func() error {
		resp, err := client.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s: status %d", url, resp.StatusCode)
		}
		return err
	}
}

// bareH3 is two mesh transports in this process, the server answering a
// fixed small JSON body.
type bareH3 struct {
	client *mesh.Transport
	body   []byte
}

func newBareH3(tb testing.TB) *bareH3 {
	tb.Helper()
	dir := mesh.NewStaticDirectory()
	answer := []byte(`{"id":"x","object":"chat.completion","model":"demo","choices":[{"index":0,"message":{"role":"assistant","content":"a b c d"},"finish_reason":"length"}]}`)
	start := func(name string, h http.Handler) *mesh.Transport {
		pub, key, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			tb.Fatal(err)
		}
		tr, err := mesh.NewTransport(mesh.TransportConfig{Name: name, Key: key, Listen: "127.0.0.1:0", Peers: dir, Handler: h})
		if err != nil {
			tb.Fatal(err)
		}
		dir.Set(name, tr.Addr().String(), pub)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = tr.Serve(ctx) }()
		tb.Cleanup(func() { cancel(); <-done })
		return tr
	}
	start("h3-server", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	}))
	return &bareH3{client: start("h3-client", nil), body: []byte(`{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)}
}

func (h *bareH3) do() error {
	req, err := http.NewRequest(http.MethodPost, "https://h3-server/v1/chat/completions", bytes.NewReader(h.body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := h.client.RoundTrip(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("h3: status %d", resp.StatusCode)
	}
	return err
}
