package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/placement"
)

// fixedResolver returns a copy of its candidates.
type fixedResolver []placement.Candidate

func (f fixedResolver) Resolve(string) []placement.Candidate { return slices.Clone(f) }

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func remote(node string, load uint32) placement.Candidate {
	return placement.Candidate{Kind: placement.KindRemote, Node: node, Load: load}
}

func nodesOf(cs []placement.Candidate) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Node
	}
	return out
}

func newScorerForTest(t *testing.T, cands ...placement.Candidate) (*PeerScorer, *fakeClock) {
	t.Helper()
	clk := &fakeClock{now: time.Unix(1000, 0)}
	s, err := NewPeerScorer(fixedResolver(cands), PeerScoreConfig{FailureThreshold: 2, Cooldown: 10 * time.Second, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	return s, clk
}

func TestPeerScorerOrder(t *testing.T) {
	local := placement.Candidate{Kind: placement.KindLocal, Node: "self", Base: "http://127.0.0.1:1"}
	tests := []struct {
		name  string
		cands []placement.Candidate
		setup func(s *PeerScorer)
		want  []string
	}{
		{"placement order kept without observations", []placement.Candidate{local, remote("b", 0), remote("c", 0)}, nil,
			[]string{"self", "b", "c"}},
		{"our in-flight adds to advertised load", []placement.Candidate{remote("b", 1), remote("c", 2)},
			func(s *PeerScorer) { s.begin("b"); s.begin("b") }, []string{"c", "b"}},
		{"recent failures break ties", []placement.Candidate{remote("b", 0), remote("c", 0)},
			func(s *PeerScorer) { s.Observe("b", false) }, []string{"c", "b"}},
		{"load beats failures below the threshold", []placement.Candidate{remote("b", 0), remote("c", 5)},
			func(s *PeerScorer) { s.Observe("b", false) }, []string{"b", "c"}},
		{"cooled down goes last whatever its load", []placement.Candidate{local, remote("b", 0), remote("c", 9), remote("d", 9)},
			func(s *PeerScorer) { s.Observe("b", false); s.Observe("b", false) }, []string{"self", "c", "d", "b"}},
		{"a success ends the cool-down", []placement.Candidate{remote("b", 0), remote("c", 1)},
			func(s *PeerScorer) { s.Observe("b", false); s.Observe("b", false); s.Observe("b", true) }, []string{"b", "c"}},
		{"single remote untouched", []placement.Candidate{local, remote("b", 0)},
			func(s *PeerScorer) { s.Observe("b", false); s.Observe("b", false) }, []string{"self", "b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := newScorerForTest(t, tt.cands...)
			if tt.setup != nil {
				tt.setup(s)
			}
			if got := nodesOf(s.Resolve("chat")); !slices.Equal(got, tt.want) {
				t.Errorf("Resolve = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPeerScorerCooldownExpires(t *testing.T) {
	s, clk := newScorerForTest(t, remote("b", 0), remote("c", 3))
	s.Observe("b", false)
	s.Observe("b", false)
	if got, want := nodesOf(s.Resolve("chat")), []string{"c", "b"}; !slices.Equal(got, want) {
		t.Fatalf("cooled: Resolve = %v, want %v", got, want)
	}
	clk.Advance(11 * time.Second)
	if got, want := nodesOf(s.Resolve("chat")), []string{"b", "c"}; !slices.Equal(got, want) {
		t.Errorf("after the cool-down: Resolve = %v, want %v", got, want)
	}
	// Still failing: one more failure cools it down again at once.
	s.Observe("b", false)
	if got, want := nodesOf(s.Resolve("chat")), []string{"c", "b"}; !slices.Equal(got, want) {
		t.Errorf("failing again: Resolve = %v, want %v", got, want)
	}
	if p := s.Peers(); len(p) != 1 || p[0].Node != "b" || !p[0].CooledDown || p[0].Failures != 3 {
		t.Errorf("Peers() = %+v, want b cooled down with 3 failures", p)
	}
}

func TestPeerScorerForgetsOldFailures(t *testing.T) {
	s, clk := newScorerForTest(t, remote("b", 0), remote("c", 0))
	s.Observe("b", false)
	if got, want := nodesOf(s.Resolve("chat")), []string{"c", "b"}; !slices.Equal(got, want) {
		t.Fatalf("after a failure: Resolve = %v, want %v", got, want)
	}
	clk.Advance(11 * time.Second)
	if got, want := nodesOf(s.Resolve("chat")), []string{"b", "c"}; !slices.Equal(got, want) {
		t.Errorf("a cool-down period later: Resolve = %v, want %v", got, want)
	}
	// An old failure does not count towards a new cool-down.
	s.Observe("b", false)
	if p := s.Peers(); p[0].Failures != 1 || p[0].CooledDown {
		t.Errorf("Peers() = %+v, want b with 1 recent failure, not cooled down", p)
	}
}

// rtFunc is a RoundTripper made of a function.
type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// brokenBody yields some bytes, then an error (a stream cut mid-way).
type brokenBody struct{ n int }

func (b *brokenBody) Read(p []byte) (int, error) {
	if b.n == 0 {
		b.n++
		return copy(p, "data: 1\n\n"), nil
	}
	return 0, errors.New("stream reset")
}
func (b *brokenBody) Close() error { return nil }

func TestPeerScorerTransportObserves(t *testing.T) {
	tests := []struct {
		name     string
		cancel   bool
		rt       rtFunc
		read     bool
		wantFail int
	}{
		{"dial error", false, func(*http.Request) (*http.Response, error) { return nil, errors.New("handshake refused") }, false, 1},
		{"client cancelled", true, func(r *http.Request) (*http.Response, error) { return nil, r.Context().Err() }, false, 0},
		{"503", false, func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 503, Body: io.NopCloser(strings.NewReader("{}"))}, nil
		}, true, 1},
		{"404 is the peer answering", false, func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 404, Body: io.NopCloser(strings.NewReader("{}"))}, nil
		}, true, 0},
		{"ok", false, func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader("{}"))}, nil
		}, true, 0},
		{"stream broken mid-way", false, func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Body: &brokenBody{}}, nil
		}, true, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := newScorerForTest(t, remote("b", 0), remote("c", 0))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tt.cancel {
				cancel()
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://b/v1/chat/completions", strings.NewReader("{}"))
			resp, err := s.Transport(tt.rt).RoundTrip(req)
			if err == nil {
				if got := s.Peers()[0].InFlight; got != 1 {
					t.Errorf("in flight while the body is open = %d, want 1", got)
				}
				if tt.read {
					_, _ = io.ReadAll(resp.Body)
				}
				resp.Body.Close()
				resp.Body.Close()
			}
			p := s.Peers()
			if len(p) != 1 || p[0].Node != "b" {
				t.Fatalf("Peers() = %+v, want only b", p)
			}
			if p[0].InFlight != 0 {
				t.Errorf("in flight after the attempt = %d, want 0", p[0].InFlight)
			}
			if p[0].Failures != tt.wantFail {
				t.Errorf("failures = %d, want %d", p[0].Failures, tt.wantFail)
			}
		})
	}
}

func TestNewPeerScorerValidates(t *testing.T) {
	tests := []struct {
		name  string
		inner Resolver
		cfg   PeerScoreConfig
		field string
	}{
		{"no inner", nil, PeerScoreConfig{}, "Resolver"},
		{"negative threshold", fixedResolver(nil), PeerScoreConfig{FailureThreshold: -1}, "FailureThreshold"},
		{"negative cooldown", fixedResolver(nil), PeerScoreConfig{Cooldown: -1}, "Cooldown"},
		{"negative header timeout", fixedResolver(nil), PeerScoreConfig{HeaderTimeout: -1}, "HeaderTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewPeerScorer(tt.inner, tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.field) {
				t.Errorf("NewPeerScorer: err = %v, want one naming %s", err, tt.field)
			}
		})
	}
	s, err := NewPeerScorer(fixedResolver(nil), PeerScoreConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if d := DefaultPeerScoreConfig(); s.cfg.FailureThreshold != d.FailureThreshold || s.cfg.Cooldown != d.Cooldown {
		t.Errorf("zero config: got threshold %d cooldown %v, want the defaults", s.cfg.FailureThreshold, s.cfg.Cooldown)
	}
}

// TestPeerScorerRefusalPerRole: a peer agent's refusal puts that peer last
// for that role only, below even a cooled-down peer, until RefusalMemory
// passes or the peer serves the role again.
func TestPeerScorerRefusalPerRole(t *testing.T) {
	s, clk := newScorerForTest(t, remote("b", 0), remote("c", 5), remote("d", 9))
	s.Observe("d", false)
	s.Observe("d", false) // d cooled down
	s.ObserveRefusal("b", "chat", RefusedNotServed)
	if got, want := nodesOf(s.Resolve("chat")), []string{"c", "d", "b"}; !slices.Equal(got, want) {
		t.Errorf("Resolve(chat) = %v, want %v", got, want)
	}
	if got, want := nodesOf(s.Resolve("embed")), []string{"b", "c", "d"}; !slices.Equal(got, want) {
		t.Errorf("Resolve(embed) = %v, want %v (the refusal is chat's only)", got, want)
	}
	if r, ok := s.Refused("b", "chat"); !ok || r.Why != RefusedNotServed {
		t.Errorf("Refused(b, chat) = %+v, %v", r, ok)
	}
	clk.Advance(DefaultPeerScoreConfig().RefusalMemory)
	if _, ok := s.Refused("b", "chat"); ok {
		t.Errorf("the refusal outlived RefusalMemory")
	}
	s.ObserveRefusal("b", "chat", RefusedNotServed)
	s.servedRole("b", "chat")
	if _, ok := s.Refused("b", "chat"); ok {
		t.Errorf("the refusal outlived a success")
	}
}
