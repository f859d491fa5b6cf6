package agent

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/infermesh/infermesh/mesh/meshbench"
)

// BenchmarkRemoteHop measures, in one run, a small non-streaming chat
// completion against the demo model four ways:
//
//	direct  client -> instance
//	local   client -> agent a -> instance (a's local role)
//	remote  client -> agent a -> QUIC -> agent b -> instance
//	h3      a bare HTTP/3 exchange between two mesh transports (the floor
//	        of the remote hop, meshbench.BareH3)
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
	waitFor(b, "a resolves chat to b", func() bool { return na.resolvesTo("chat", "b") })
	waitFor(b, "a's local instance is up", func() bool { return len(na.agent.Table().Resolve("local")) == 1 })

	h3, err := meshbench.NewBareH3()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(h3.Close)
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
		{"h3", func() error { return h3.Do(context.Background(), body("chat")) }},
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
