package enginestat

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
)

// engineModel serves the demo model's engine mode: 2 slots, a cache,
// metrics in format.
func engineModel(t *testing.T, format string) *httptest.Server {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Parallel, cfg.Metrics, cfg.CacheTokens, cfg.CacheBlock = 2, format, 4096, 4
	cfg.DecodePerToken, cfg.TokenDelay, cfg.Tokens = 20*time.Millisecond, 20*time.Millisecond, 200
	m, err := demomodel.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(m)
	t.Cleanup(s.Close)
	return s
}

func fetch(t *testing.T, url string) []byte {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s = %d: %s", url, resp.StatusCode, b)
	}
	return b
}

// Against the engine mode in both formats, auto-detected and named: with
// 3 streams sent to 2 slots, 2 run and 1 waits, and the KV cache is in
// use; llama.cpp's /slots counts the 2 slots.
func TestParseEngineMetrics(t *testing.T) {
	for _, format := range []string{demomodel.MetricsLlamaCpp, demomodel.MetricsVLLM} {
		t.Run(format, func(t *testing.T) {
			s := engineModel(t, format)
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			for range 3 {
				wg.Go(func() {
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/v1/chat/completions",
						strings.NewReader(`{"model":"demo","stream":true,"messages":[{"role":"user","content":"a prompt long enough to fill some cache blocks of the engine, and then some more words"}]}`))
					req.Header.Set("Content-Type", "application/json")
					if resp, err := http.DefaultClient.Do(req); err == nil {
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				})
			}
			defer func() { cancel(); wg.Wait() }()
			var st Stats
			deadline := time.Now().Add(30 * time.Second)
			for {
				var err error
				if st, err = Parse(fetch(t, s.URL+"/metrics"), Auto); err != nil {
					t.Fatal(err)
				}
				if st.Running == 2 && st.Waiting == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("stats %+v, want 2 running and 1 waiting", st)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if st.Engine != format || !st.HasKV || st.KVUsage <= 0 || st.KVUsage > 1 {
				t.Errorf("stats %+v: want engine %s and the KV cache in use", st, format)
			}
			named, err := Parse(fetch(t, s.URL+"/metrics"), format)
			if err != nil || named.Engine != format {
				t.Errorf("Parse(%s) = %+v, %v", format, named, err)
			}
			other := map[string]string{LlamaCpp: VLLM, VLLM: LlamaCpp}[format]
			if _, err := Parse(fetch(t, s.URL+"/metrics"), other); err == nil {
				t.Errorf("%s's metrics read as %s", format, other)
			}
			// vLLM's cache_config_info: 1,024 blocks of 4 tokens.
			if want := map[string]float64{LlamaCpp: 0, VLLM: 4096}[format]; st.CacheTokens != want {
				t.Errorf("cache tokens %v, want %v", st.CacheTokens, want)
			}
			// vLLM's prefix cache counters (in tokens); llama.cpp has none.
			if format == VLLM && (!st.HasPrefix || st.PrefixQueries <= 0 || st.PrefixHits > st.PrefixQueries) {
				t.Errorf("stats %+v: want vLLM's prefix cache counters, queries above 0", st)
			}
			if format == LlamaCpp && st.HasPrefix {
				t.Errorf("stats %+v: llama.cpp read with prefix cache counters", st)
			}
			if format == LlamaCpp {
				n, ctx, err := ParseSlots(fetch(t, s.URL+"/slots"))
				if err != nil || n != 2 || ctx != 4096 {
					t.Errorf("slots = %d (context %v), %v; want 2 holding 4096 tokens together", n, ctx, err)
				}
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	if _, err := Parse([]byte("go_goroutines 7\n"), Auto); err != ErrUnknownEngine {
		t.Errorf("another server's metrics: %v, want ErrUnknownEngine", err)
	}
	if _, err := Parse([]byte("not { metrics"), Auto); err == nil {
		t.Error("garbage parsed")
	}
	if _, _, err := ParseSlots([]byte(`{"error":"slots disabled"}`)); err == nil {
		t.Error("an error object read as slots")
	}
	// vLLM's gauges once per model are summed; a NaN is skipped; KV use
	// is clamped to 1.
	st, err := Parse([]byte(`vllm:num_requests_running{model_name="a"} 2
vllm:num_requests_running{model_name="b"} 3
vllm:num_requests_waiting{model_name="a"} NaN
vllm:gpu_cache_usage_perc{model_name="a"} 1.5
`), Auto)
	if err != nil || st.Running != 5 || st.Waiting != 0 || st.KVUsage != 1 || !st.HasKV {
		t.Errorf("vLLM of two models = %+v, %v", st, err)
	}
	// vLLM v0's prefix cache counters; hits above queries are held to them.
	st, err = Parse([]byte(`vllm:num_requests_running 0
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total 100
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total 150
`), Auto)
	if err != nil || !st.HasPrefix || st.PrefixQueries != 100 || st.PrefixHits != 100 {
		t.Errorf("vLLM v0 prefix counters = %+v, %v", st, err)
	}
	for _, m := range []string{"", Auto, LlamaCpp, VLLM, None} {
		if !ValidMode(m) {
			t.Errorf("ValidMode(%q) = false", m)
		}
	}
	if ValidMode("sglang") {
		t.Error("ValidMode(sglang) = true")
	}
}

// vLLM's cache_config_info as vLLM writes it; a block count or size that
// is not a count reads as unknown, never as a cache.
func TestVLLMCacheConfigInfo(t *testing.T) {
	const head = "vllm:num_requests_running 1\n# TYPE vllm:cache_config_info gauge\n"
	for _, tc := range []struct {
		labels string
		want   float64
	}{
		{`block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27008"`, 27008 * 16},
		{`block_size="16",num_gpu_blocks="None"`, 0},
		{`block_size="-1",num_gpu_blocks="8"`, 0},
		{`num_gpu_blocks="8"`, 0},
		{`block_size="4294967295",num_gpu_blocks="4294967295"`, 1<<32 - 1},
	} {
		st, err := Parse([]byte(head+"vllm:cache_config_info{"+tc.labels+"} 1.0\n"), VLLM)
		if err != nil || st.CacheTokens != tc.want {
			t.Errorf("%s: %v tokens, %v; want %v", tc.labels, st.CacheTokens, err, tc.want)
		}
	}
}
