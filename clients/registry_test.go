package clients

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// clock is a Registry's time, moved by hand.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newTestRegistry(t *testing.T, p Policy, cs ...Client) (*Registry, *clock) {
	t.Helper()
	r := NewRegistry(p)
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	r.now = c.now
	if err := r.Set(cs, p); err != nil {
		t.Fatal(err)
	}
	return r, c
}

func mustKey(t *testing.T) string {
	t.Helper()
	k, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestKeyForm(t *testing.T) {
	k := mustKey(t)
	if !LooksLikeKey(k) || !strings.HasPrefix(k, "im-") {
		t.Fatalf("NewKey() = %q, want im- and %d characters", k, keyLen)
	}
	if k2 := mustKey(t); k2 == k {
		t.Fatal("two keys are the same")
	}
	if h := KeyHint(k); !strings.HasSuffix(h, k[len(k)-4:]) || strings.Contains(h, k[3:12]) {
		t.Fatalf("KeyHint = %q: want the last four only", h)
	}
	got, err := ParseHash(HashString(HashKey(k)))
	if err != nil || got != HashKey(k) {
		t.Fatalf("ParseHash(HashString(h)) = %x, %v", got, err)
	}
}

func TestIdentify(t *testing.T) {
	key := mustKey(t)
	other := mustKey(t) // an im- key nobody holds: revoked or rotated
	app := Client{Name: "app", KeyHash: HashKey(key), Roles: []string{"chat"}}
	batch := Client{Name: "batch", HasUID: true, UID: 1001}
	unit := Client{Name: "svc", Unit: "etl.service"}
	for _, tc := range []struct {
		name       string
		require    bool
		caller     Caller
		role       string
		wantClient string
		wantStatus int
		wantCode   string
	}{
		{"key", false, Caller{Key: key}, "chat", "app", 0, ""},
		{"key, require", true, Caller{Key: key}, "chat", "app", 0, ""},
		{"key on a role it does not list", false, Caller{Key: key}, "embed", "app", http.StatusForbidden, "role_not_allowed"},
		{"no key", false, Caller{}, "chat", Anonymous, 0, ""},
		{"no key, require", true, Caller{}, "chat", "", http.StatusUnauthorized, "invalid_api_key"},
		{"a placeholder key", false, Caller{Key: "sk-no-key-needed"}, "chat", Anonymous, 0, ""},
		{"a placeholder key, require", true, Caller{Key: "sk-no-key-needed"}, "chat", "", http.StatusUnauthorized, "invalid_api_key"},
		{"an unknown im- key", false, Caller{Key: other}, "chat", "", http.StatusUnauthorized, "invalid_api_key"},
		{"uid", true, Caller{HasCreds: true, UID: 1001}, "embed", "batch", 0, ""},
		{"unit", true, Caller{HasCreds: true, UID: 5, Unit: "etl.service"}, "chat", "svc", 0, ""},
		{"unknown creds, require", true, Caller{HasCreds: true, UID: 5}, "chat", "", http.StatusUnauthorized, "invalid_api_key"},
		{"key before creds", false, Caller{Key: key, HasCreds: true, UID: 1001}, "chat", "app", 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := newTestRegistry(t, Policy{RequireKey: tc.require}, app, batch, unit)
			tk, ref := r.Admit(tc.caller, tc.role)
			if tc.wantStatus != 0 {
				if ref == nil || ref.Status != tc.wantStatus || ref.Code != tc.wantCode {
					t.Fatalf("Admit = %+v, want %d %s", ref, tc.wantStatus, tc.wantCode)
				}
				if strings.Contains(ref.Message, key) || strings.Contains(ref.Message, other) {
					t.Fatalf("the refusal names the key: %q", ref.Message)
				}
				return
			}
			if ref != nil {
				t.Fatalf("Admit refused: %+v", ref)
			}
			if tk.Name() != tc.wantClient {
				t.Fatalf("client = %q, want %q", tk.Name(), tc.wantClient)
			}
			tk.Done(0, 0)
		})
	}
}

func TestRemovedAndRotatedKeysRefusedAtOnce(t *testing.T) {
	old, next := mustKey(t), mustKey(t)
	r, _ := newTestRegistry(t, Policy{}, Client{Name: "app", KeyHash: HashKey(old), Limits: Limits{MaxConcurrent: 2}})
	held, ref := r.Admit(Caller{Key: old}, "chat")
	if ref != nil {
		t.Fatal(ref.Message)
	}
	// Rotation: the same client, a new key.
	if err := r.Set([]Client{{Name: "app", KeyHash: HashKey(next), Limits: Limits{MaxConcurrent: 2}}}, Policy{}); err != nil {
		t.Fatal(err)
	}
	if _, ref := r.Admit(Caller{Key: old}, "chat"); ref == nil || ref.Status != http.StatusUnauthorized {
		t.Fatalf("the rotated-out key: %+v, want 401", ref)
	}
	// The client's use survives the rotation: one held, one more fits.
	tk, ref := r.Admit(Caller{Key: next}, "chat")
	if ref != nil {
		t.Fatal(ref.Message)
	}
	if _, ref := r.Admit(Caller{Key: next}, "chat"); ref == nil || ref.Kind != "concurrency" {
		t.Fatalf("third in flight: %+v, want a concurrency refusal", ref)
	}
	held.Done(0, 0)
	tk.Done(0, 0)
	if err := r.Set(nil, Policy{}); err != nil {
		t.Fatal(err)
	}
	if _, ref := r.Admit(Caller{Key: next}, "chat"); ref == nil || ref.Status != http.StatusUnauthorized {
		t.Fatalf("the removed client's key: %+v, want 401", ref)
	}
}

func TestRequestsPerMinute(t *testing.T) {
	key := mustKey(t)
	r, clk := newTestRegistry(t, Policy{}, Client{Name: "app", KeyHash: HashKey(key), Limits: Limits{RPM: 6}})
	for i := range 6 {
		tk, ref := r.Admit(Caller{Key: key}, "chat")
		if ref != nil {
			t.Fatalf("request %d of a burst of 6 refused: %s", i, ref.Message)
		}
		tk.Done(0, 0)
	}
	_, ref := r.Admit(Caller{Key: key}, "chat")
	if ref == nil || ref.Status != http.StatusTooManyRequests || ref.Code != "rate_limit_exceeded" || ref.Kind != "rpm" {
		t.Fatalf("7th request: %+v, want 429 rate_limit_exceeded (rpm)", ref)
	}
	// 6 a minute refill one every 10 s.
	if got := ref.RetryAfterSeconds(); got != 10 {
		t.Fatalf("Retry-After = %d s, want 10", got)
	}
	want := map[string]string{"X-Ratelimit-Limit-Requests": "6", "X-Ratelimit-Remaining-Requests": "0", "X-Ratelimit-Reset-Requests": "1m0s"}
	got := map[string]string{}
	for _, h := range ref.Headers {
		got[h.Name] = h.Value
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
	clk.add(9 * time.Second)
	if _, ref := r.Admit(Caller{Key: key}, "chat"); ref == nil {
		t.Fatal("admitted 9 s later; one request refills in 10 s")
	}
	clk.add(time.Second)
	tk, ref := r.Admit(Caller{Key: key}, "chat")
	if ref != nil {
		t.Fatalf("refused once the window let one in: %s", ref.Message)
	}
	tk.Done(0, 0)
	st, _, _ := r.Stats()
	if st[1].Name != "app" || st[1].Requests != 7 || st[1].Refused["rpm"] != 2 {
		t.Fatalf("stats = %+v, want app: 7 requests, 2 refused by rpm", st[1])
	}
}

func TestTokensPerMinuteChargedAfterTheFact(t *testing.T) {
	key := mustKey(t)
	r, clk := newTestRegistry(t, Policy{}, Client{Name: "app", KeyHash: HashKey(key), Limits: Limits{TPM: 600}})
	tk, ref := r.Admit(Caller{Key: key}, "chat")
	if ref != nil {
		t.Fatal(ref.Message)
	}
	// One request may cost more than the bucket holds: the balance goes
	// below zero, and the refill pays it back before the next is let in.
	tk.Done(500, 400) // 900 of 600: -300
	_, ref = r.Admit(Caller{Key: key}, "chat")
	if ref == nil || ref.Kind != "tpm" || ref.Type != "tokens" {
		t.Fatalf("after a request over the balance: %+v, want a tpm refusal", ref)
	}
	// 600 a minute refill 10 a second: 300 + 1 take 30.1 s.
	if got := ref.RetryAfterSeconds(); got != 31 {
		t.Fatalf("Retry-After = %d s, want 31", got)
	}
	clk.add(31 * time.Second)
	tk, ref = r.Admit(Caller{Key: key}, "chat")
	if ref != nil {
		t.Fatalf("refused after the balance came back: %s", ref.Message)
	}
	tk.Done(1, 1)
}

func TestConcurrency(t *testing.T) {
	key := mustKey(t)
	r, _ := newTestRegistry(t, Policy{Anonymous: Client{Limits: Limits{MaxConcurrent: 1}}}, Client{Name: "app", KeyHash: HashKey(key), Limits: Limits{MaxConcurrent: 3}})
	var held []Ticket
	for range 3 {
		tk, ref := r.Admit(Caller{Key: key}, "chat")
		if ref != nil {
			t.Fatal(ref.Message)
		}
		held = append(held, tk)
	}
	if _, ref := r.Admit(Caller{Key: key}, "chat"); ref == nil || ref.Status != http.StatusTooManyRequests || ref.RetryAfterSeconds() != 1 {
		t.Fatalf("4th in flight: %+v, want 429 with Retry-After 1", ref)
	}
	// Another client is not affected.
	anon, ref := r.Admit(Caller{}, "chat")
	if ref != nil {
		t.Fatalf("anonymous refused while app is at its limit: %s", ref.Message)
	}
	if _, ref := r.Admit(Caller{}, "chat"); ref == nil {
		t.Fatal("anonymous admitted over its own max_concurrent 1")
	}
	anon.Done(0, 0)
	held[0].Done(0, 0)
	tk, ref := r.Admit(Caller{Key: key}, "chat")
	if ref != nil {
		t.Fatalf("refused once one ended: %s", ref.Message)
	}
	tk.Done(0, 0)
	for _, h := range held[1:] {
		h.Done(0, 0)
	}
	if st, _, _ := r.Stats(); st[1].InFlight != 0 || st[0].InFlight != 0 {
		t.Fatalf("in flight after every Done: %+v", st)
	}
}

func TestSetRefusesConflicts(t *testing.T) {
	k := HashKey(mustKey(t))
	for _, tc := range []struct {
		name string
		cs   []Client
		want string
	}{
		{"name", []Client{{Name: "a"}, {Name: "a"}}, "named twice"},
		{"key", []Client{{Name: "a", KeyHash: k}, {Name: "b", KeyHash: k}}, `has the key of client "a"`},
		{"uid", []Client{{Name: "a", HasUID: true, UID: 7}, {Name: "b", HasUID: true, UID: 7}}, "uid 7"},
		{"unit", []Client{{Name: "a", Unit: "x.service"}, {Name: "b", Unit: "x.service"}}, `unit "x.service"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := NewRegistry(Policy{})
			if err := r.Set(tc.cs, Policy{}); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Set = %v, want an error with %q", err, tc.want)
			}
		})
	}
}

func TestValidateName(t *testing.T) {
	for name, ok := range map[string]bool{"app": true, "a.b-c_d": true, "9x": true, "": false, "-x": false, "a b": false,
		Anonymous: false, strings.Repeat("x", 64): false, strings.Repeat("x", 63): true} {
		if err := ValidateName(name); (err == nil) != ok {
			t.Errorf("ValidateName(%q) = %v, want ok %v", name, err, ok)
		}
	}
}

func TestPriority(t *testing.T) {
	for _, s := range []string{"high", "normal", "low", ""} {
		p, err := ParsePriority(s)
		if err != nil || (s != "" && p.String() != s) {
			t.Errorf("ParsePriority(%q) = %v, %v", s, p, err)
		}
	}
	if _, err := ParsePriority("urgent"); err == nil {
		t.Error("ParsePriority(urgent) accepted")
	}
	if !(High > Normal && Normal > Low) {
		t.Error("High > Normal > Low does not hold")
	}
}
