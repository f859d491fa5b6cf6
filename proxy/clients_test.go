package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/infermesh/infermesh/clients"
	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
)

func newKey(t *testing.T) string {
	t.Helper()
	k, err := clients.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func registry(t *testing.T, p clients.Policy, cs ...clients.Client) *clients.Registry {
	t.Helper()
	r := clients.NewRegistry(p)
	if err := r.Set(cs, p); err != nil {
		t.Fatal(err)
	}
	return r
}

// authRecorder answers a chat completion and keeps the Authorization
// and api-key headers the instance saw.
type authRecorder struct {
	mu   sync.Mutex
	seen []string
}

func (a *authRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	a.mu.Lock()
	a.seen = append(a.seen, r.Header.Get("Authorization")+"|"+r.Header.Get("Api-Key"))
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","model":"m","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}`)
}

// TestClientKeys: with require_key, a request is served with a client's
// key (Bearer or api-key) and refused with OpenAI's errors without one,
// with an unknown one, or on a role the client does not list; the key
// never reaches the instance nor the access log, which names the client.
func TestClientKeys(t *testing.T) {
	key, chatless := newKey(t), newKey(t)
	reg := registry(t, clients.Policy{RequireKey: true},
		clients.Client{Name: "app", KeyHash: clients.HashKey(key), Roles: []string{"chat"}},
		clients.Client{Name: "embedder", KeyHash: clients.HashKey(chatless), Roles: []string{"embed"}})
	core, logs := observer.New(zapcore.InfoLevel)
	e := newEnv(t, Config{Clients: reg, AccessLog: zap.New(core)})
	inst := &authRecorder{}
	e.upstream(inst, "m")
	body := `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		name   string
		hdr    []string
		status int
		code   string
	}{
		{"bearer", []string{"Authorization", "Bearer " + key}, 200, ""},
		{"api-key", []string{"Api-Key", key}, 200, ""},
		{"no key", nil, 401, "invalid_api_key"},
		{"a placeholder", []string{"Authorization", "Bearer sk-anything"}, 401, "invalid_api_key"},
		{"unknown im- key", []string{"Authorization", "Bearer " + newKey(t)}, 401, "invalid_api_key"},
		{"a role the client does not list", []string{"Authorization", "Bearer " + chatless}, 403, "role_not_allowed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := e.post(pathChat, body, tc.hdr...)
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status || (tc.code != "" && !strings.Contains(string(b), `"code":"`+tc.code+`"`)) {
				t.Fatalf("got %d %s, want %d %s", resp.StatusCode, b, tc.status, tc.code)
			}
		})
	}
	// The SDK's own error for a missing key.
	sdk := openai.NewClient(option.WithBaseURL(e.url+"/v1"), option.WithAPIKey(""), option.WithMaxRetries(0))
	_, err := sdk.Chat.Completions.New(context.Background(), chatParams("chat"))
	assertAPIError(t, err, 401, "invalid_api_key")
	// /v1/models needs the key too.
	if resp := e.post(pathModels, ""); resp.StatusCode != 401 {
		t.Errorf("POST /v1/models without a key: %d, want 401", resp.StatusCode)
	}

	inst.mu.Lock()
	seen := append([]string(nil), inst.seen...)
	inst.mu.Unlock()
	if len(seen) != 2 || seen[0] != "|" || seen[1] != "|" {
		t.Errorf("the instance saw credentials %q: the client's key must stop at the proxy", seen)
	}
	if n := len(logs.FilterField(zap.String("client", "app")).All()); n != 2 {
		t.Errorf("access log lines naming client app: %d, want 2", n)
	}
	for _, l := range logs.All() {
		if s := fmt.Sprint(l.ContextMap()); strings.Contains(s, key) || strings.Contains(s, chatless) {
			t.Fatalf("the access log holds a key: %s", s)
		}
	}
}

// TestClientOverItsLimitSDKRetries: a client over its rpm limit gets 429
// rate_limit_exceeded with Retry-After and OpenAI's rate-limit headers,
// another client is unaffected, and the SDK's own retry gets through once
// the bucket refills (60 a minute: one a second).
func TestClientOverItsLimitSDKRetries(t *testing.T) {
	key, other := newKey(t), newKey(t)
	const rpm = 60
	reg := registry(t, clients.Policy{},
		clients.Client{Name: "app", KeyHash: clients.HashKey(key), Limits: clients.Limits{RPM: rpm}},
		clients.Client{Name: "other", KeyHash: clients.HashKey(other)})
	e := newEnv(t, Config{Clients: reg})
	e.upstream(&authRecorder{}, "m")
	body := `{"model":"chat","messages":[]}`
	var last *http.Response
	for i := 0; i <= rpm; i++ {
		last = e.post(pathChat, body, "Authorization", "Bearer "+key)
		_, _ = io.Copy(io.Discard, last.Body)
		if i < rpm && last.StatusCode != 200 {
			t.Fatalf("request %d of the burst: %d", i, last.StatusCode)
		}
	}
	if last.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("request %d: %d, want 429", rpm+1, last.StatusCode)
	}
	ra, err := strconv.Atoi(last.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > 2 {
		t.Errorf("Retry-After = %q, want 1 or 2 s", last.Header.Get("Retry-After"))
	}
	for h, want := range map[string]string{"X-Ratelimit-Limit-Requests": "60", "X-Ratelimit-Remaining-Requests": "0"} {
		if got := last.Header.Get(h); got != want {
			t.Errorf("%s = %q, want %q", h, got, want)
		}
	}
	if last.Header.Get("X-Ratelimit-Reset-Requests") == "" || last.Header.Get("Retry-After-Ms") == "" {
		t.Errorf("no reset or retry-after-ms: %v", last.Header)
	}
	if resp := e.post(pathChat, body, "Authorization", "Bearer "+other); resp.StatusCode != 200 {
		t.Errorf("another client while app is over its limit: %d, want 200", resp.StatusCode)
	}
	// The SDK retries a 429 after Retry-After(-Ms): its first try is
	// refused (the bucket is still empty), a retry gets through.
	attempts := 0
	sdk := openai.NewClient(option.WithBaseURL(e.url+"/v1"), option.WithAPIKey(key), option.WithMaxRetries(3),
		option.WithMiddleware(func(r *http.Request, next option.MiddlewareNext) (*http.Response, error) {
			attempts++
			return next(r)
		}))
	if _, err := sdk.Chat.Completions.New(context.Background(), chatParams("chat")); err != nil {
		t.Fatalf("the SDK's retries did not get through: %v", err)
	}
	if attempts < 2 {
		t.Errorf("the SDK got through on attempt %d: the limit did not hold", attempts)
	}
}

// TestClientTokensChargedFromUsage: the usage the instance reports is
// charged to the client's tpm bucket, which may go below zero: the next
// request is refused until it refills.
func TestClientTokensChargedFromUsage(t *testing.T) {
	key := newKey(t)
	reg := registry(t, clients.Policy{}, clients.Client{Name: "app", KeyHash: clients.HashKey(key), Limits: clients.Limits{TPM: 10}})
	e := newEnv(t, Config{Clients: reg})
	e.upstream(&authRecorder{}, "m") // 12 tokens a request
	body := `{"model":"chat","messages":[]}`
	if resp := e.post(pathChat, body, "Authorization", "Bearer "+key); resp.StatusCode != 200 {
		t.Fatalf("first request: %d", resp.StatusCode)
	}
	resp := e.post(pathChat, body, "Authorization", "Bearer "+key)
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 429 || resp.Header.Get("X-Ratelimit-Limit-Tokens") != "10" || !strings.Contains(string(b), "tokens per minute") {
		t.Fatalf("second request after 12 of 10 tokens: %d %s %v, want 429 over tpm", resp.StatusCode, b, resp.Header)
	}
	st, _, _ := reg.Stats()
	if st[1].PromptTokens != 7 || st[1].CompletionTokens != 5 || st[1].Requests != 1 || st[1].Refused["tpm"] != 1 {
		t.Errorf("stats = %+v, want 7+5 tokens, 1 request, 1 refused by tpm", st[1])
	}
}

// TestClientConcurrencyFreedOnEveryEnd: a request that ends any way
// (served, refused by the model check, the instance gone) leaves its
// client's requests in flight.
func TestClientConcurrencyFreedOnEveryEnd(t *testing.T) {
	key := newKey(t)
	reg := registry(t, clients.Policy{}, clients.Client{Name: "app", KeyHash: clients.HashKey(key), Limits: clients.Limits{MaxConcurrent: 1}})
	e := newEnv(t, Config{Clients: reg})
	e.upstream(&authRecorder{}, "m")
	for _, body := range []string{`{"model":"chat"}`, `{"model":"nope"}`, `not json`, `{"model":"chat"}`} {
		resp := e.post(pathChat, body, "Authorization", "Bearer "+key)
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode == 429 {
			t.Fatalf("%s: 429: an earlier request was not let go", body)
		}
	}
	if st, _, _ := reg.Stats(); st[1].InFlight != 0 {
		t.Fatalf("in flight after every request ended: %d", st[1].InFlight)
	}
}

// TestClientNameCrossesTheHop: a consumer sends its client's name over the
// hop, never its key; the serving side logs it as the consumer's word.
func TestClientNameCrossesTheHop(t *testing.T) {
	// The serving side: b's PeerHandler in front of its instance.
	table, _ := placement.New(placement.Config{NodeID: "b"})
	d, _ := demomodel.New(demomodel.DefaultConfig())
	up := httptest.NewServer(d)
	defer up.Close()
	if err := table.RegisterLocal("chat", placement.Local{Base: up.URL, Model: "demo"}); err != nil {
		t.Fatal(err)
	}
	table.ExposeToMesh("chat", true)
	table.AllowMeshPeer("chat", "a", true)
	core, logs := observer.New(zapcore.InfoLevel)
	pb, err := New(Config{Resolver: table, Peers: table, AccessLog: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	var gotClient, gotAuth string
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		gotClient, gotAuth = r.Header.Get(ClientHeader), r.Header.Get("Authorization")
		mu.Unlock()
		pb.PeerHandler(func(*http.Request) (string, bool) { return "a", true }, nil).ServeHTTP(w, r)
	}))
	defer srv.Close()

	key := newKey(t)
	reg := registry(t, clients.Policy{}, clients.Client{Name: "app", KeyHash: clients.HashKey(key)})
	e := newEnv(t, Config{Clients: reg, Resolver: fakeResolver{{Kind: placement.KindRemote, Node: "b"}}, Remote: loopRemote{"b": srv.URL}})
	resp := e.post(pathChat, `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`, "Authorization", "Bearer "+key, ClientHeader, "forged")
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("via b: %d %s", resp.StatusCode, b)
	}
	mu.Lock()
	defer mu.Unlock()
	if gotClient != "app" || gotAuth != "" {
		t.Errorf("b saw client %q and Authorization %q; want app and none", gotClient, gotAuth)
	}
	lines := logs.FilterField(zap.String("client", "app")).FilterField(zap.String("client_node", "a")).All()
	if len(lines) != 1 {
		t.Errorf("b's access log: %d lines of client app according to a, want 1 (all: %v)", len(lines), logs.All())
	}
}

// TestQueueByPriority: the role's queue holds high before normal before
// low, first in first out within each.
func TestQueueByPriority(t *testing.T) {
	var q routeQueue
	order := []clients.Priority{clients.Normal, clients.Low, clients.High, clients.Normal, clients.High, clients.Low}
	names := map[*waiter]string{}
	for i, p := range order {
		w, ok := q.join(10, p)
		if !ok {
			t.Fatal("queue full")
		}
		names[w] = p.String() + strconv.Itoa(i)
	}
	var got []string
	for _, w := range q.waiters {
		got = append(got, names[w])
	}
	if want := "high2 high4 normal0 normal3 low1 low5"; strings.Join(got, " ") != want {
		t.Errorf("queue = %v, want %s", got, want)
	}
	if _, ok := q.join(6, clients.High); ok {
		t.Error("joined a full queue")
	}
}

// TestClientPriorityOrdersTheQueue: with every candidate full, a high
// priority client's request leaves the queue before a low one that
// waited longer.
func TestClientPriorityOrdersTheQueue(t *testing.T) {
	hi, lo := newKey(t), newKey(t)
	reg := registry(t, clients.Policy{},
		clients.Client{Name: "hi", KeyHash: clients.HashKey(hi), Priority: clients.High},
		clients.Client{Name: "lo", KeyHash: clients.HashKey(lo), Priority: clients.Low})
	e := newRouteEnvWith(t, RouteConfig{QueueMax: 4, QueueTimeout: 20 * time.Second}, func(c *Config) { c.Clients = reg })
	e.res.fresh = true
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	long := e.sendBody(t.Context(), "long", body, "Authorization", "Bearer "+lo)
	wait(t, "long at the local instance", func() bool { return e.local.has("long") })
	cands := e.res.Resolve("chat")
	cands[1].Load = 1 // b full too
	e.res.set(cands...)
	low := e.sendBody(t.Context(), "low", body, "Authorization", "Bearer "+lo)
	wait(t, "low queued", func() bool { return e.p.QueueLen("chat") == 1 })
	high := e.sendBody(t.Context(), "high", body, "Authorization", "Bearer "+hi)
	wait(t, "high queued", func() bool { return e.p.QueueLen("chat") == 2 })
	close(e.local.ch("long"))
	<-long
	wait(t, "one left the queue", func() bool { return e.local.has("high") || e.local.has("low") })
	if e.local.has("low") {
		t.Fatalf("the low priority request left the queue first: %v", e.local.order())
	}
	close(e.local.ch("high"))
	<-high
	wait(t, "low at the local instance", func() bool { return e.local.has("low") })
	close(e.local.ch("low"))
	if a := <-low; a.status != 200 {
		t.Fatalf("low: %+v", a)
	}
}
