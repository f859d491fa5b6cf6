package demomodel

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// engineConfig is an engine-mode config whose streams, once started, last
// until their client goes away (one token, then an hour per token).
func engineConfig(parallel int) Config {
	return Config{Parallel: parallel, Tokens: 8, DecodePerToken: time.Hour}
}

// call is one request in flight, sent by its own goroutine, until its
// client is canceled or the answer is read.
type call struct {
	cancel context.CancelFunc
	status chan int // the response head's status (0: none came)
	body   chan []byte
	done   chan struct{}
}

func startCall(t *testing.T, ts *httptest.Server, body string) *call {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &call{cancel: cancel, status: make(chan int, 1), body: make(chan []byte, 1), done: make(chan struct{})}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(c.done)
		resp, err := ts.Client().Do(req)
		if err != nil {
			c.status <- 0
			return
		}
		c.status <- resp.StatusCode
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		c.body <- b
	}()
	t.Cleanup(func() { cancel(); <-c.done })
	return c
}

// waitStatus waits for the call's response head.
func (c *call) waitStatus(t *testing.T) int {
	t.Helper()
	select {
	case st := <-c.status:
		return st
	case <-time.After(30 * time.Second):
		t.Fatal("timed out waiting for a response head")
		return 0
	}
}

// stop cancels the call and waits for its goroutine.
func (c *call) stop() {
	c.cancel()
	<-c.done
}

func chatBody(stream bool, messages ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `{"model":"demo","stream":%v,"stream_options":%s,"messages":[`, stream, map[bool]string{true: `{"include_usage":true}`, false: "null"}[stream])
	for i := 0; i < len(messages); i += 2 {
		if i > 0 {
			b.WriteByte(',')
		}
		role, _ := json.Marshal(messages[i])
		content, _ := json.Marshal(messages[i+1])
		fmt.Fprintf(&b, `{"role":%s,"content":%s}`, role, content)
	}
	b.WriteString("]}")
	return b.String()
}

// waitStats waits until the server's counters satisfy cond.
func waitStats(t *testing.T, s *Server, what string, cond func(Stats) bool) Stats {
	t.Helper()
	var st Stats
	waitFor(t, what, func() bool { st = s.Stats(); return cond(st) })
	return st
}

// Five concurrent requests on four slots: the fifth waits, without a
// response head, until a slot is freed; then it runs.
func TestEngineFifthWaits(t *testing.T) {
	s, ts, _ := startServer(t, engineConfig(4))
	var calls []*call
	for i := range 4 {
		calls = append(calls, startCall(t, ts, chatBody(true, "user", fmt.Sprint("request ", i))))
	}
	waitStats(t, s, "4 running", func(st Stats) bool { return st.Running == 4 })
	for _, c := range calls {
		if st := c.waitStatus(t); st != http.StatusOK {
			t.Fatalf("a running request's status = %d, want 200", st)
		}
	}
	fifth := startCall(t, ts, chatBody(true, "user", "the fifth"))
	st := waitStats(t, s, "the fifth waiting", func(st Stats) bool { return st.Waiting == 1 })
	if st.Running != 4 || st.StreamsStarted != 4 {
		t.Errorf("with the fifth waiting: running %d, streams started %d; want 4 and 4", st.Running, st.StreamsStarted)
	}
	select {
	case status := <-fifth.status:
		t.Fatalf("the fifth got a response head (%d) while it waits for a slot", status)
	default:
	}
	calls[2].stop()
	if status := fifth.waitStatus(t); status != http.StatusOK {
		t.Fatalf("the fifth's status = %d, want 200 once a slot is free", status)
	}
	st = waitStats(t, s, "the fifth on the freed slot", func(st Stats) bool { return st.Waiting == 0 && st.StreamsStarted == 5 })
	if st.Running != 4 {
		t.Errorf("running = %d, want 4", st.Running)
	}
}

// The queue is first come, first served.
func TestEngineQueueFIFO(t *testing.T) {
	s, ts, _ := startServer(t, engineConfig(1))
	first := startCall(t, ts, chatBody(true, "user", "first"))
	waitStats(t, s, "first running", func(st Stats) bool { return st.Running == 1 })
	second := startCall(t, ts, chatBody(true, "user", "second"))
	waitStats(t, s, "second waiting", func(st Stats) bool { return st.Waiting == 1 })
	third := startCall(t, ts, chatBody(true, "user", "third"))
	waitStats(t, s, "third waiting", func(st Stats) bool { return st.Waiting == 2 })
	first.stop()
	if status := second.waitStatus(t); status != http.StatusOK {
		t.Fatalf("second's status = %d, want 200: it waited longest", status)
	}
	waitStats(t, s, "third still waiting", func(st Stats) bool { return st.Waiting == 1 && st.Running == 1 })
	second.stop()
	if status := third.waitStatus(t); status != http.StatusOK {
		t.Fatalf("third's status = %d, want 200", status)
	}
}

// A client that goes away frees its place: in the queue, in the prefill
// and while it streams.
func TestEngineDisconnectFreesSlot(t *testing.T) {
	t.Run("queued and running", func(t *testing.T) {
		s, ts, _ := startServer(t, engineConfig(1))
		running := startCall(t, ts, chatBody(true, "user", "running"))
		waitStats(t, s, "running", func(st Stats) bool { return st.Running == 1 })
		queued := startCall(t, ts, chatBody(true, "user", "queued"))
		waitStats(t, s, "queued", func(st Stats) bool { return st.Waiting == 1 })
		queued.stop()
		waitStats(t, s, "the queue empty again", func(st Stats) bool { return st.Waiting == 0 && st.Running == 1 })
		running.stop()
		waitStats(t, s, "the slot free", func(st Stats) bool { return st.Running == 0 })
		next := startCall(t, ts, chatBody(true, "user", "next"))
		if status := next.waitStatus(t); status != http.StatusOK {
			t.Fatalf("next's status = %d, want 200 on the freed slot", status)
		}
		if st := s.Stats(); st.Canceled != 2 || st.Waiting != 0 {
			t.Errorf("canceled %d, waiting %d; want 2 and 0", st.Canceled, st.Waiting)
		}
	})
	t.Run("prefilling", func(t *testing.T) {
		s, ts, _ := startServer(t, Config{Parallel: 1, PrefillPerToken: time.Hour})
		c := startCall(t, ts, chatBody(true, "user", "a long prefill"))
		waitStats(t, s, "prefilling", func(st Stats) bool { return st.Running == 1 && st.PrefilledTokens > 0 })
		c.stop()
		st := waitStats(t, s, "the slot free", func(st Stats) bool { return st.Running == 0 })
		if st.StreamsStarted != 0 || st.Canceled != 1 {
			t.Errorf("streams started %d, canceled %d; want 0 and 1", st.StreamsStarted, st.Canceled)
		}
	})
}

// usage reads a response's usage: from a JSON body, or from the usage
// chunk of a stream.
func usageOf(t *testing.T, body []byte) (prompt, completion, cached int) {
	t.Helper()
	var u struct {
		Usage *struct {
			PromptTokens        int `json:"prompt_tokens"`
			CompletionTokens    int `json:"completion_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	found := false
	for _, line := range strings.Split(string(body), "\n") {
		line = strings.TrimPrefix(line, "data: ")
		if !strings.HasPrefix(line, "{") || json.Unmarshal([]byte(line), &u) != nil || u.Usage == nil {
			continue
		}
		found = true
		if u.Usage.PromptTokensDetails == nil {
			t.Fatalf("usage %s lacks prompt_tokens_details", line)
		}
		prompt, completion, cached = u.Usage.PromptTokens, u.Usage.CompletionTokens, u.Usage.PromptTokensDetails.CachedTokens
	}
	if !found {
		t.Fatalf("no usage in %q", body)
	}
	return prompt, completion, cached
}

// generate sends one request and returns its usage.
func generate(t *testing.T, ts *httptest.Server, stream bool, messages ...string) (prompt, completion, cached int) {
	t.Helper()
	status, _, b := postJSON(t, ts, "/v1/chat/completions", chatBody(stream, messages...))
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, b)
	}
	return usageOf(t, b)
}

// A repeated prefix is found in the cache: cached_tokens says so, and the
// prefill covers the rest only.
func TestEnginePrefixCache(t *testing.T) {
	const prefill = 2 * time.Millisecond
	s, ts, _ := startServer(t, Config{Parallel: 1, Tokens: 3, PrefillPerToken: prefill, CacheTokens: 4096, CacheBlock: 8})
	system := strings.Repeat("You are a careful assistant. ", 28)[:800] // 200 tokens: 25 blocks
	query1, query2 := strings.Repeat("q", 40), strings.Repeat("r", 40)  // 10 tokens each

	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "non-stream", true: "stream"}[stream], func(t *testing.T) {
			if _, err := http.Post(ts.URL+"/reset_prefix_cache", "", nil); err != nil {
				t.Fatal(err)
			}
			before := s.Stats()
			start := time.Now()
			prompt, completion, cached := generate(t, ts, stream, "system", system, "user", query1)
			cold := time.Since(start)
			if prompt != 210 || completion != 3 || cached != 0 {
				t.Errorf("cold: prompt, completion, cached = %d, %d, %d; want 210, 3, 0", prompt, completion, cached)
			}
			// The sleep's lower bound holds on any host.
			if min := 210 * prefill; cold < min {
				t.Errorf("cold request took %v, less than its prefill of 210 tokens (%v)", cold, min)
			}
			mid := s.Stats()
			prompt, _, cached = generate(t, ts, stream, "system", system, "user", query2)
			if prompt != 210 || cached != 200 {
				t.Errorf("warm: prompt, cached = %d, %d; want 210, 200 (the system prompt's 25 blocks)", prompt, cached)
			}
			after := s.Stats()
			if got, want := mid.PrefilledTokens-before.PrefilledTokens, uint64(210); got != want {
				t.Errorf("cold prefill = %d tokens, want %d", got, want)
			}
			if got, want := after.PrefilledTokens-mid.PrefilledTokens, uint64(10); got != want {
				t.Errorf("warm prefill = %d tokens, want %d", got, want)
			}
			if cold, warm := mid.PrefillTime-before.PrefillTime, after.PrefillTime-mid.PrefillTime; cold != 210*prefill || warm != 10*prefill {
				t.Errorf("prefill time cold %v, warm %v; want %v and %v", cold, warm, 210*prefill, 10*prefill)
			}
			if got := after.CachedTokens - mid.CachedTokens; got != 200 {
				t.Errorf("Stats().CachedTokens grew by %d, want 200", got)
			}
		})
	}

	t.Run("whole prompt", func(t *testing.T) {
		// 16 tokens, two full blocks: a repeat finds both, and computes
		// the last token again.
		msg := strings.Repeat("w", 64)
		if _, _, cached := generate(t, ts, false, "user", msg); cached != 0 {
			t.Errorf("first: cached %d, want 0", cached)
		}
		if prompt, _, cached := generate(t, ts, false, "user", msg); prompt != 16 || cached != 15 {
			t.Errorf("repeat: prompt, cached = %d, %d; want 16, 15", prompt, cached)
		}
	})
	t.Run("another role", func(t *testing.T) {
		msg := strings.Repeat("z", 64)
		generate(t, ts, false, "user", msg)
		if _, _, cached := generate(t, ts, false, "system", msg); cached != 0 {
			t.Errorf("the same content as system: cached %d, want 0 (the role is part of the first token)", cached)
		}
	})
}

// The cache evicts the least recently used blocks, and a prefix from its
// end.
func TestEngineLRUEviction(t *testing.T) {
	// Blocks of 4 tokens; prompts of 8 blocks (128 bytes, one message);
	// room for 16 blocks.
	s, ts, _ := startServer(t, Config{Parallel: 1, Tokens: 1, CacheTokens: 64, CacheBlock: 4})
	prompt := func(c byte) string { return strings.Repeat(string(c), 128) }
	cached := func(c byte) int {
		t.Helper()
		_, _, n := generate(t, ts, false, "user", prompt(c))
		return n
	}
	const whole = 31 // 32 tokens, the last computed again
	for _, c := range []byte("ab") {
		if n := cached(c); n != 0 {
			t.Fatalf("first %c: cached %d, want 0", c, n)
		}
	}
	if n := cached('a'); n != whole { // a is now more recent than b
		t.Fatalf("a again: cached %d, want %d", n, whole)
	}
	if n := cached('c'); n != 0 { // evicts b, the least recently used
		t.Fatalf("c: cached %d, want 0", n)
	}
	if st := s.Stats(); st.CacheEvictions != 8 || st.CacheTokens != 64 {
		t.Errorf("evictions %d, cache tokens %d; want 8 and 64", st.CacheEvictions, st.CacheTokens)
	}
	if n := cached('a'); n != whole {
		t.Errorf("a after c: cached %d, want %d (a was used after b)", n, whole)
	}
	if n := cached('b'); n != 0 {
		t.Errorf("b after c: cached %d, want 0 (evicted)", n)
	}
	// b's blocks evicted c's (used before a's last use).
	if n := cached('c'); n != 0 {
		t.Errorf("c after b: cached %d, want 0", n)
	}

	t.Run("a prefix from its end", func(t *testing.T) {
		// Room for 10 blocks: a (8) then d (4 blocks) leaves a's first 6.
		s, ts, _ := startServer(t, Config{Parallel: 1, Tokens: 1, CacheTokens: 40, CacheBlock: 4})
		generate(t, ts, false, "user", prompt('a'))
		generate(t, ts, false, "user", strings.Repeat("d", 64))
		if _, _, n := generate(t, ts, false, "user", prompt('a')); n != 24 {
			t.Errorf("a after d: cached %d, want 24 (its first 6 blocks)", n)
		}
		if st := s.Stats(); st.CacheEvictions < 2 {
			t.Errorf("evictions %d, want at least 2", st.CacheEvictions)
		}
	})
}

// max_tokens bounds the output in engine mode too.
func TestEngineMaxTokens(t *testing.T) {
	_, ts, _ := startServer(t, Config{Parallel: 2, Tokens: 6})
	body := `{"model":"demo","max_tokens":2,"messages":[{"role":"user","content":"short"}]}`
	status, _, b := postJSON(t, ts, "/v1/chat/completions", body)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, b)
	}
	if _, completion, _ := usageOf(t, b); completion != 2 || !bytes.Contains(b, []byte(`"finish_reason":"length"`)) {
		t.Errorf("completion tokens %d in %s, want 2 and finish_reason length", completion, b)
	}
}

// scrape fetches /metrics and parses it with Prometheus's own text parser.
func scrape(t *testing.T, ts *httptest.Server) (map[string]*dto.MetricFamily, http.Header) {
	t.Helper()
	resp, err := ts.Client().Get(ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics status %d", resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams, resp.Header
}

// value is a family's value: a gauge's or counter's, summed over its
// series whose labels include match.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, typ dto.MetricType, match map[string]string) float64 {
	t.Helper()
	f := fams[name]
	if f == nil {
		t.Fatalf("no family %s", name)
		return 0
	}
	if f.GetType() != typ {
		t.Errorf("%s is a %v, want %v", name, f.GetType(), typ)
	}
	var sum float64
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		ok := true
		for k, v := range match {
			ok = ok && labels[k] == v
		}
		if !ok {
			continue
		}
		if typ == dto.MetricType_COUNTER {
			sum += m.GetCounter().GetValue()
		} else {
			sum += m.GetGauge().GetValue()
		}
	}
	return sum
}

// Both formats parse with Prometheus's parser, with the names, types and
// values of the engine's state.
func TestEngineMetrics(t *testing.T) {
	const gauge, counter = dto.MetricType_GAUGE, dto.MetricType_COUNTER
	for _, format := range []string{MetricsLlamaCpp, MetricsVLLM} {
		t.Run(format, func(t *testing.T) {
			cfg := Config{Parallel: 1, Tokens: 2, DecodePerToken: time.Hour, CacheTokens: 1024, CacheBlock: 8, Metrics: format, Model: `m"x`}
			s, ts, _ := startServer(t, cfg)
			body := func(prompt string) string {
				return `{"model":"m\"x","max_tokens":1,"messages":[{"role":"user","content":"` + prompt + `"}]}`
			}
			long := strings.Repeat("p", 96) // 24 tokens, 3 blocks
			for range 2 {
				if status, _, b := postJSON(t, ts, "/v1/chat/completions", body(long)); status != 200 {
					t.Fatalf("status %d: %s", status, b)
				}
			}
			// Now one running (streaming for an hour) and one waiting.
			startCall(t, ts, `{"model":"m\"x","stream":true,"messages":[{"role":"user","content":"hold"}]}`)
			waitStats(t, s, "one running", func(st Stats) bool { return st.Running == 1 && st.StreamsStarted == 1 })
			startCall(t, ts, body("queued"))
			waitStats(t, s, "one waiting", func(st Stats) bool { return st.Waiting == 1 })
			fams, hdr := scrape(t, ts)
			st := s.Stats()
			type famWant struct {
				name string
				typ  dto.MetricType
				want float64
			}
			var wants []famWant
			var match map[string]string
			if format == MetricsLlamaCpp {
				if ct := hdr.Get("Content-Type"); ct != "text/plain; version=0.0.4" {
					t.Errorf("Content-Type %q", ct)
				}
				if hdr.Get("Process-Start-Time-Unix") == "" {
					t.Errorf("no Process-Start-Time-Unix header")
				}
				wants = []famWant{
					{"llamacpp:requests_processing", gauge, 1},
					{"llamacpp:requests_deferred", gauge, 1},
					// 24 tokens, then 24 less the 23 cached, then "hold" (1).
					{"llamacpp:prompt_tokens_total", counter, float64(st.PrefilledTokens)},
					{"llamacpp:prompt_tokens_total", counter, 24 + 1 + 1},
					{"llamacpp:tokens_predicted_total", counter, float64(st.CompletionTokens)},
					{"llamacpp:kv_cache_tokens", gauge, float64(st.CacheTokens)},
					{"llamacpp:kv_cache_usage_ratio", gauge, float64(st.CacheTokens) / 1024},
				}
				for _, name := range []string{"llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"} {
					value(t, fams, name, counter, nil)
				}
				for _, name := range []string{"llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds"} {
					value(t, fams, name, gauge, nil)
				}
			} else {
				if ct := hdr.Get("Content-Type"); ct != "text/plain; version=0.0.4; charset=utf-8" {
					t.Errorf("Content-Type %q", ct)
				}
				match = map[string]string{"model_name": `m"x`, "engine": "0"}
				wants = []famWant{
					{"vllm:num_requests_running", gauge, 1},
					{"vllm:num_requests_waiting", gauge, 1},
					{"vllm:prefix_cache_queries_total", counter, 24 + 24 + 1},
					{"vllm:prefix_cache_hits_total", counter, 23},
					{"vllm:prompt_tokens_total", counter, 24 + 24 + 1},
					{"vllm:generation_tokens_total", counter, float64(st.CompletionTokens)},
					// The running request holds one block of 8 of the 128.
					{"vllm:kv_cache_usage_perc", gauge, 8.0 / 1024},
					{"vllm:gpu_cache_usage_perc", gauge, 8.0 / 1024},
				}
				for reason, want := range map[string]float64{"stop": 0, "length": 2, "abort": 0} {
					m := map[string]string{"model_name": `m"x`, "engine": "0", "finished_reason": reason}
					if got := value(t, fams, "vllm:request_success_total", counter, m); got != want {
						t.Errorf("request_success_total{finished_reason=%q} = %v, want %v", reason, got, want)
					}
				}
			}
			for _, c := range wants {
				if got := value(t, fams, c.name, c.typ, match); got != c.want {
					t.Errorf("%s = %v, want %v", c.name, got, c.want)
				}
			}
		})
	}
	t.Run("none", func(t *testing.T) {
		_, ts, _ := startServer(t, Config{Parallel: 1})
		for _, path := range []string{"/metrics", "/slots"} {
			resp, err := ts.Client().Get(ts.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound {
				t.Errorf("%s without metrics: status %d, want 404", path, resp.StatusCode)
			}
		}
	})
}

// GET /slots in llama-server's shape.
func TestEngineSlots(t *testing.T) {
	s, ts, _ := startServer(t, Config{Parallel: 2, Tokens: 5, DecodePerToken: time.Hour, CacheTokens: 1000, Metrics: MetricsLlamaCpp})
	get := func(path string) (int, []map[string]any) {
		t.Helper()
		resp, err := ts.Client().Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var slots []map[string]any
		if resp.StatusCode == 200 {
			if err := json.Unmarshal(b, &slots); err != nil {
				t.Fatalf("%s: %v: %s", path, err, b)
			}
		}
		return resp.StatusCode, slots
	}
	status, slots := get("/slots")
	if status != 200 || len(slots) != 2 {
		t.Fatalf("/slots = %d, %v; want 2 slots", status, slots)
	}
	for i, sl := range slots {
		if sl["id"] != float64(i) || sl["n_ctx"] != float64(500) || sl["is_processing"] != false || sl["speculative"] != false || len(sl) != 4 {
			t.Errorf("idle slot %d = %v, want id, n_ctx 500, is_processing false, speculative false only", i, sl)
		}
	}
	c := startCall(t, ts, chatBody(true, "user", strings.Repeat("s", 40)))
	waitStats(t, s, "running", func(st Stats) bool { return st.Running == 1 && st.CompletionTokens == 1 })
	_, slots = get("/slots")
	sl := slots[0]
	if sl["is_processing"] != true || sl["id_task"] != float64(1) || sl["n_prompt_tokens"] != float64(10) ||
		sl["n_prompt_tokens_processed"] != float64(10) || sl["n_prompt_tokens_cache"] != float64(0) {
		t.Errorf("busy slot = %v", sl)
	}
	next, _ := sl["next_token"].([]any)
	if len(next) != 1 {
		t.Fatalf("next_token = %v, want one object", sl["next_token"])
	}
	nt := next[0].(map[string]any)
	if nt["n_decoded"] != float64(1) || nt["n_remain"] != float64(4) || nt["has_next_token"] != true {
		t.Errorf("next_token = %v, want 1 decoded, 4 remaining", nt)
	}
	if params, _ := sl["params"].(map[string]any); params["n_predict"] != float64(5) || params["stream"] != true {
		t.Errorf("params = %v", sl["params"])
	}
	if status, _ := get("/slots?fail_on_no_slot=1"); status != 200 {
		t.Errorf("fail_on_no_slot with a slot idle: %d, want 200", status)
	}
	c2 := startCall(t, ts, chatBody(true, "user", "second"))
	waitStats(t, s, "both running", func(st Stats) bool { return st.Running == 2 })
	if status, _ := get("/slots?fail_on_no_slot=1"); status != http.StatusServiceUnavailable {
		t.Errorf("fail_on_no_slot with every slot busy: %d, want 503", status)
	}
	c.stop()
	c2.stop()
	waitStats(t, s, "idle", func(st Stats) bool { return st.Running == 0 })
	_, slots = get("/slots")
	if slots[0]["is_processing"] != false || slots[0]["id_task"] != float64(1) {
		t.Errorf("slot 0 after its task = %v, want idle, keeping task 1", slots[0])
	}
}

// While loading, everything but the model list answers 503 "Loading
// model", as llama-server does.
func TestLoading(t *testing.T) {
	s, ts, _ := startServer(t, Config{LoadTime: time.Hour})
	check := func(method, path string, want int) {
		t.Helper()
		req, _ := http.NewRequest(method, ts.URL+path, strings.NewReader(`{"messages":[{"role":"user","content":"x"}]}`))
		resp, err := ts.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != want {
			t.Errorf("%s %s = %d %s, want %d", method, path, resp.StatusCode, b, want)
		}
		if want == 503 && string(b) != `{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}` {
			t.Errorf("%s %s body %s, want llama-server's loading error", method, path, b)
		}
	}
	check("GET", "/health", 503)
	check("POST", "/v1/chat/completions", 503)
	check("GET", "/v1/models", 200)
	check("GET", "/v1/models/demo", 200)
	s.now = func() time.Time { return time.Now().Add(time.Hour) }
	check("GET", "/health", 200)
	check("POST", "/v1/chat/completions", 200)
	if st := s.Stats(); st.Health != 2 {
		t.Errorf("health requests = %d, want 2", st.Health)
	}
}

func TestEngineConfigValidation(t *testing.T) {
	for _, tt := range []struct {
		name      string
		cfg       Config
		wantField string
	}{
		{"engine", Config{Parallel: 4, PrefillPerToken: time.Microsecond, DecodePerToken: time.Millisecond, CacheTokens: 1000, CacheBlock: 16, Metrics: MetricsVLLM, LoadTime: time.Second}, ""},
		{"decode equals delay", Config{DecodePerToken: time.Millisecond, TokenDelay: time.Millisecond}, ""},
		{"load time alone", Config{LoadTime: time.Second}, ""},
		{"negative parallel", Config{Parallel: -1}, "Parallel"},
		{"huge parallel", Config{Parallel: MaxParallel + 1}, "Parallel"},
		{"negative prefill", Config{Parallel: 1, PrefillPerToken: -1}, "PrefillPerToken"},
		{"prefill without slots", Config{PrefillPerToken: time.Millisecond}, "PrefillPerToken"},
		{"cache without slots", Config{CacheTokens: 100}, "CacheTokens"},
		{"metrics without slots", Config{Metrics: MetricsLlamaCpp}, "Metrics"},
		{"unknown metrics", Config{Parallel: 1, Metrics: "tgi"}, "Metrics"},
		{"decode and delay differ", Config{DecodePerToken: time.Millisecond, TokenDelay: 2 * time.Millisecond}, "DecodePerToken"},
		{"cache smaller than a block", Config{Parallel: 1, CacheTokens: 10, CacheBlock: 16}, "CacheTokens"},
		{"negative block", Config{Parallel: 1, CacheBlock: -1}, "CacheBlock"},
		{"negative load time", Config{LoadTime: -time.Second}, "LoadTime"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			switch {
			case tt.wantField == "" && err != nil:
				t.Fatalf("New: %v", err)
			case tt.wantField != "" && (err == nil || !strings.Contains(err.Error(), tt.wantField)):
				t.Fatalf("New error = %v, want one naming %s", err, tt.wantField)
			}
		})
	}
}

// The token rule, exactly.
func TestTokenizePrompt(t *testing.T) {
	tok := func(raw string, chat bool, block int) promptTokens {
		return tokenizePrompt([]byte(raw), chat, block, nil)
	}
	msg := func(role, content string) string { return `{"role":"` + role + `","content":"` + content + `"}` }
	for _, tt := range []struct {
		name   string
		raw    string
		chat   bool
		tokens int
	}{
		{"empty content is one token", `[` + msg("user", "") + `]`, true, 1},
		{"1 byte", `[` + msg("user", "a") + `]`, true, 1},
		{"4 bytes", `[` + msg("user", "abcd") + `]`, true, 1},
		{"5 bytes", `[` + msg("user", "abcde") + `]`, true, 2},
		{"messages add up", `[` + msg("system", strings.Repeat("s", 8000)) + `,` + msg("user", strings.Repeat("q", 400)) + `]`, true, 2100},
		{"escapes count unescaped", `[` + msg("user", `\n\n\n\n\n`) + `]`, true, 2},
		{"parts", `[{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"text","text":"efgh"}]}]`, true, 2},
		{"null content", `[{"role":"assistant","content":null,"tool_calls":[]}]`, true, 1},
		{"text prompt", `"` + strings.Repeat("x", 10) + `"`, false, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := tok(tt.raw, tt.chat, 64); got.n != tt.tokens || len(got.blocks) != tt.tokens/64 {
				t.Errorf("tokens, blocks = %d, %d; want %d, %d", got.n, len(got.blocks), tt.tokens, tt.tokens/64)
			}
		})
	}
	// A block hash names its whole prefix: the same block after different
	// blocks hashes differently; the same prefix the same.
	a := tok(`[`+msg("user", strings.Repeat("a", 16)+strings.Repeat("c", 16))+`]`, true, 4)
	b := tok(`[`+msg("user", strings.Repeat("b", 16)+strings.Repeat("c", 16))+`]`, true, 4)
	a2 := tok(`[`+msg("user", strings.Repeat("a", 16)+strings.Repeat("d", 16))+`]`, true, 4)
	if len(a.blocks) != 2 || a.blocks[1] == b.blocks[1] {
		t.Errorf("block 2 after different blocks: %x vs %x, want different", a.blocks, b.blocks)
	}
	if a.blocks[0] != a2.blocks[0] || a.blocks[1] == a2.blocks[1] {
		t.Errorf("shared first block: %x vs %x, want the first equal, the second not", a.blocks, a2.blocks)
	}
	// Blocks run across message boundaries, which still count.
	one := tok(`[`+msg("user", strings.Repeat("e", 32))+`]`, true, 4)
	two := tok(`[`+msg("user", strings.Repeat("e", 16))+`,`+msg("user", strings.Repeat("e", 16))+`]`, true, 4)
	if len(one.blocks) != 2 || len(two.blocks) != 2 || one.blocks[1] == two.blocks[1] {
		t.Errorf("one message %x vs two %x: want 2 blocks each, the second different", one.blocks, two.blocks)
	}
}

// POST /reset_prefix_cache empties the cache.
func TestEngineResetCache(t *testing.T) {
	s, ts, _ := startServer(t, Config{Parallel: 1, Tokens: 1, CacheTokens: 256, CacheBlock: 4})
	body := strings.Repeat("k", 64)
	generate(t, ts, false, "user", body)
	if _, _, n := generate(t, ts, false, "user", body); n != 15 {
		t.Fatalf("repeat: cached %d, want 15", n)
	}
	status, _, b := postJSON(t, ts, "/reset_prefix_cache", "")
	if status != 200 || s.Stats().CacheTokens != 0 {
		t.Fatalf("reset: %d %s, cache tokens %d", status, b, s.Stats().CacheTokens)
	}
	if _, _, n := generate(t, ts, false, "user", body); n != 0 {
		t.Errorf("after reset: cached %d, want 0", n)
	}
}
