package placement

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestNewConfig(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
		wantTTL time.Duration
	}{
		{"missing node id", Config{}, "Config.NodeID", 0},
		{"negative ttl", Config{NodeID: "a", AdvertTTL: -time.Second}, "Config.AdvertTTL", 0},
		{"defaults", Config{NodeID: "a"}, "", DefaultAdvertTTL},
		{"custom ttl", Config{NodeID: "a", AdvertTTL: time.Second}, "", time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tbl, err := New(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("New(%+v) = %v, want error naming %s", tt.cfg, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			if got := tbl.AdvertTTL(); got != tt.wantTTL {
				t.Errorf("AdvertTTL() = %v, want %v", got, tt.wantTTL)
			}
			if got := tbl.NodeID(); got != "a" {
				t.Errorf("NodeID() = %q, want a", got)
			}
			if got := tbl.Generation(); got != 0 {
				t.Errorf("Generation() = %d, want 0", got)
			}
		})
	}
	if d := DefaultConfig(); d.AdvertTTL != DefaultAdvertTTL || d.Now == nil {
		t.Errorf("DefaultConfig() = %+v, want TTL %v and a clock", d, DefaultAdvertTTL)
	}
}

func TestRegisterLocal(t *testing.T) {
	tests := []struct {
		name     string
		role     string
		base     string
		wantErr  error
		wantBase string
	}{
		{"ok", "chat", "http://127.0.0.1:8081/", nil, "http://127.0.0.1:8081"},
		{"ipv6", "chat", "http://[::1]:8081", nil, "http://[::1]:8081"},
		{"bad role", "a/b", "http://127.0.0.1:8081", ErrBadRole, ""},
		{"empty role", "", "http://127.0.0.1:8081", ErrBadRole, ""},
		{"remote base", "chat", "http://10.0.0.2:8081", ErrBadBase, ""},
		{"no port", "chat", "http://127.0.0.1", ErrBadBase, ""},
		{"path", "chat", "http://127.0.0.1:8081/v1", ErrBadBase, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			err := env.t.RegisterLocal(tt.role, Local{Base: tt.base, Model: "m"})
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("RegisterLocal(%q, %q) = %v, want %v", tt.role, tt.base, err, tt.wantErr)
				}
				if got := env.t.Generation(); got != 0 {
					t.Errorf("Generation() after refused register = %d, want 0", got)
				}
				if c := env.t.Resolve(tt.role); c != nil {
					t.Errorf("Resolve(%q) = %+v, want nil", tt.role, c)
				}
				return
			}
			if err != nil {
				t.Fatalf("RegisterLocal: %v", err)
			}
			got := env.t.Resolve(tt.role)
			want := []Candidate{{Kind: KindLocal, Node: "a", Base: tt.wantBase, Model: "m"}}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("Resolve(%q) = %+v, want %+v", tt.role, got, want)
			}
		})
	}
}

// TestGeneration runs a sequence of operations on one table and checks,
// step by step, that the generation moves only on real change and that
// Changed fires exactly then.
func TestGeneration(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	l := Local{Base: "http://127.0.0.1:8081", Model: "m", API: "openai", Runtime: "demo"}
	steps := []struct {
		name string
		op   func()
		bump bool
	}{
		{"register", func() { _ = tb.RegisterLocal("chat", l) }, true},
		{"register same", func() { _ = tb.RegisterLocal("chat", l) }, false},
		{"register same, trailing slash", func() {
			_ = tb.RegisterLocal("chat", Local{Base: l.Base + "/", Model: "m", API: "openai", Runtime: "demo"})
		}, false},
		{"register new model", func() { _ = tb.RegisterLocal("chat", Local{Base: l.Base, Model: "m2", API: "openai", Runtime: "demo"}) }, true},
		{"register new base", func() {
			_ = tb.RegisterLocal("chat", Local{Base: "http://127.0.0.1:9000", Model: "m2", API: "openai", Runtime: "demo"})
		}, true},
		{"register refused", func() { _ = tb.RegisterLocal("chat", Local{Base: "http://10.0.0.1:1"}) }, false},
		{"set local load", func() { tb.SetLocalLoad("chat", 7) }, false},
		{"expose", func() { tb.ExposeToMesh("chat", true) }, true},
		{"expose again", func() { tb.ExposeToMesh("chat", true) }, false},
		{"allow remote", func() { tb.AllowRemoteNode("chat", "b", true) }, true},
		{"allow remote again", func() { tb.AllowRemoteNode("chat", "b", true) }, false},
		{"allow mesh peer", func() { tb.AllowMeshPeer("chat", "c", true) }, true},
		{"allow mesh peer again", func() { tb.AllowMeshPeer("chat", "c", true) }, false},
		{"disallow mesh peer never listed", func() { tb.AllowMeshPeer("chat", "zz", false) }, false},
		{"proxy port", func() { tb.SetProxyPort("chat", 18080) }, true},
		{"proxy port same", func() { tb.SetProxyPort("chat", 18080) }, false},
		{"proxy port cleared", func() { tb.SetProxyPort("chat", 0) }, true},
		{"proxy port cleared again", func() { tb.SetProxyPort("chat", 0) }, false},
		{"ingest new", func() { _ = tb.IngestAdvertisement("b", advert("chat", "b", 1)) }, true},
		{"ingest repeat", func() { _ = tb.IngestAdvertisement("b", advert("chat", "b", 1)) }, false},
		{"ingest repeat after 30s", func() { env.clock.Advance(30 * time.Second); _ = tb.IngestAdvertisement("b", advert("chat", "b", 1)) }, false},
		{"ingest new load", func() { _ = tb.IngestAdvertisement("b", advert("chat", "b", 2)) }, true},
		{"ingest new model", func() {
			ad := advert("chat", "b", 2)
			ad.Model = "other"
			_ = tb.IngestAdvertisement("b", ad)
		}, true},
		{"ingest new methods", func() {
			ad := advert("chat", "b", 2)
			ad.Model = "other"
			ad.Methods = []string{"embeddings"}
			_ = tb.IngestAdvertisement("b", ad)
		}, true},
		{"ingest refused", func() { _ = tb.IngestAdvertisement("c", advert("chat", "c", 0)) }, false},
		{"time passes within ttl", func() { env.clock.Advance(59 * time.Second) }, false},
		{"time passes beyond ttl", func() { env.clock.Advance(2 * time.Second) }, false},
		{"ingest after expiry", func() {
			ad := advert("chat", "b", 2)
			ad.Model = "other"
			ad.Methods = []string{"embeddings"}
			_ = tb.IngestAdvertisement("b", ad)
		}, true},
		{"expire stale, nothing stale", func() { tb.ExpireStale() }, false},
		{"expire stale", func() { env.clock.Advance(2 * time.Minute); tb.ExpireStale() }, true},
		{"ingest again", func() { _ = tb.IngestAdvertisement("b", advert("chat", "b", 0)) }, true},
		{"withdraw unknown", func() { tb.Withdraw("chat", "c") }, false},
		{"withdraw", func() { tb.Withdraw("chat", "b") }, true},
		{"withdraw again", func() { tb.Withdraw("chat", "b") }, false},
		{"ingest once more", func() { _ = tb.IngestAdvertisement("b", advert("chat", "b", 0)) }, true},
		{"remove unknown node", func() { tb.RemoveNode("zz") }, false},
		{"remove node", func() { tb.RemoveNode("b") }, true},
		{"remove node again", func() { tb.RemoveNode("b") }, false},
		{"disallow remote", func() { tb.AllowRemoteNode("chat", "b", false) }, true},
		{"disallow remote again", func() { tb.AllowRemoteNode("chat", "b", false) }, false},
		{"policy with bad role", func() { tb.AllowRemoteNode("a/b", "b", true) }, false},
		{"unexpose", func() { tb.ExposeToMesh("chat", false) }, true},
		{"deregister", func() { tb.DeregisterLocal("chat") }, true},
		{"deregister again", func() { tb.DeregisterLocal("chat") }, false},
		{"reads", func() {
			tb.Resolve("chat")
			tb.Explain("chat")
			tb.Snapshot()
			tb.LocalForPeer("chat", "c")
			tb.Advertisements()
			tb.NextExpiry()
		}, false},
	}
	for _, s := range steps {
		before := tb.Generation()
		ch := tb.Changed()
		s.op()
		after := tb.Generation()
		if s.bump {
			if after != before+1 {
				t.Errorf("%s: Generation() = %d, want %d (one bump)", s.name, after, before+1)
			}
			if !closed(ch) {
				t.Errorf("%s: Changed() channel not closed after a change", s.name)
			}
			if closed(tb.Changed()) {
				t.Errorf("%s: fresh Changed() channel already closed", s.name)
			}
		} else {
			if after != before {
				t.Errorf("%s: Generation() = %d, want %d (no bump)", s.name, after, before)
			}
			if closed(ch) {
				t.Errorf("%s: Changed() channel closed without a change", s.name)
			}
		}
	}
}

func TestChangedWakesWaiter(t *testing.T) {
	env := newTestTable(t)
	ch := env.t.Changed()
	done := make(chan uint64)
	go func() {
		<-ch
		done <- env.t.Generation()
	}()
	env.t.ExposeToMesh("chat", true)
	select {
	case g := <-done:
		if g < 1 {
			t.Errorf("Generation() seen by waiter = %d, want >= 1", g)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("waiter on Changed() never woke")
	}
}

func TestPolicyAudit(t *testing.T) {
	tests := []struct {
		name string
		op   func(*Table)
		want []AuditEvent
	}{
		{
			"allow remote on/off",
			func(tb *Table) {
				tb.AllowRemoteNode("chat", "b", true)
				tb.AllowRemoteNode("chat", "b", true) // no change, not audited
				tb.AllowRemoteNode("chat", "b", false)
			},
			[]AuditEvent{
				{Kind: AuditRemoteAllow, Role: "chat", Node: "b", Fields: map[string]string{"allowed": "true", "consumer": "a"}},
				{Kind: AuditRemoteAllow, Role: "chat", Node: "b", Fields: map[string]string{"allowed": "false", "consumer": "a"}},
			},
		},
		{
			"allow mesh peer",
			func(tb *Table) {
				tb.AllowMeshPeer("chat", "c", true)
				tb.AllowMeshPeer("chat", "c", true)
				tb.AllowMeshPeer("chat", "c", false)
				tb.AllowMeshPeer("chat", "c", false)
			},
			[]AuditEvent{
				{Kind: AuditMeshAllow, Role: "chat", Node: "c", Fields: map[string]string{"allowed": "true", "server": "a"}},
				{Kind: AuditMeshAllow, Role: "chat", Node: "c", Fields: map[string]string{"allowed": "false", "server": "a"}},
			},
		},
		{
			"expose",
			func(tb *Table) {
				tb.ExposeToMesh("chat", true)
				tb.ExposeToMesh("chat", true)
				tb.ExposeToMesh("chat", false)
			},
			[]AuditEvent{
				{Kind: AuditMeshExpose, Role: "chat", Fields: map[string]string{"exposed": "true", "node_id": "a"}},
				{Kind: AuditMeshExpose, Role: "chat", Fields: map[string]string{"exposed": "false", "node_id": "a"}},
			},
		},
		{
			"refused policy calls",
			func(tb *Table) {
				tb.AllowRemoteNode("a/b", "b", true)
				tb.AllowMeshPeer("chat", "", true)
				tb.ExposeToMesh("", true)
			},
			[]AuditEvent{
				{Kind: AuditPolicyRefused, Role: "a/b", Node: "b", Fields: map[string]string{"op": "allow_remote_node", "why": string(ReasonBadRole), "node_id": "a"}},
				{Kind: AuditPolicyRefused, Role: "chat", Node: "", Fields: map[string]string{"op": "allow_mesh_peer", "why": string(ReasonEmptyNode), "node_id": "a"}},
				{Kind: AuditPolicyRefused, Role: "", Node: "", Fields: map[string]string{"op": "expose_to_mesh", "why": string(ReasonBadRole), "node_id": "a"}},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			tt.op(env.t)
			if got := env.audit.take(); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("audit events =\n%+v\nwant\n%+v", got, tt.want)
			}
		})
	}
}

// TestAuditOutsideLock: the sink calls back into the table (read and write
// lock); if any event were emitted under the lock this would deadlock.
func TestAuditOutsideLock(t *testing.T) {
	env := newTestTable(t)
	env.audit.table = env.t
	done := make(chan struct{})
	go func() {
		defer close(done)
		env.t.AllowRemoteNode("chat", "b", true)
		env.t.AllowMeshPeer("chat", "b", true)
		env.t.ExposeToMesh("chat", true)
		env.t.ExposeToMesh("bad/role", true)
		_ = env.t.IngestAdvertisement("c", advert("chat", "c", 0)) // refused: not allowlisted
		_ = env.t.IngestAdvertisement("x", advert("chat", "x", 0)) // refused: not admitted
		env.t.LocalForPeer("chat", "d")                            // refused: not on serve list
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("deadlock: an audit event was emitted while holding the table lock")
	}
	if got, want := len(env.audit.take()), 7; got != want {
		t.Errorf("audit events = %d, want %d", got, want)
	}
}

func TestAllowlistQueries(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	tb.AllowMeshPeer("chat", "b", true)
	tb.AllowMeshPeer("embed", "c", true)
	tb.AllowRemoteNode("chat", "d", true)
	tb.ExposeToMesh("embed", true)
	tb.ExposeToMesh("chat", true)
	tb.ExposeToMesh("rerank", true)
	tb.ExposeToMesh("rerank", false)

	checks := []struct {
		name      string
		got, want bool
	}{
		{"MeshPeerAllowed(chat, b)", tb.MeshPeerAllowed("chat", "b"), true},
		{"MeshPeerAllowed(chat, c)", tb.MeshPeerAllowed("chat", "c"), false},
		{"MeshPeerAllowed(embed, c)", tb.MeshPeerAllowed("embed", "c"), true},
		{"MeshPeerAllowed(none, b)", tb.MeshPeerAllowed("none", "b"), false},
		{"MeshPeerAllowed(chat, d) (consumer list only)", tb.MeshPeerAllowed("chat", "d"), false},
		{"RemoteNodeAllowed(chat, d)", tb.RemoteNodeAllowed("chat", "d"), true},
		{"RemoteNodeAllowed(chat, b) (serve list only)", tb.RemoteNodeAllowed("chat", "b"), false},
		{"PeerListedAny(b)", tb.PeerListedAny("b"), true},
		{"PeerListedAny(c)", tb.PeerListedAny("c"), true},
		{"PeerListedAny(d) (consumer list only)", tb.PeerListedAny("d"), false},
		{"PeerListedAny(zz)", tb.PeerListedAny("zz"), false},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if got, want := tb.ExposedRoles(), []string{"chat", "embed"}; !reflect.DeepEqual(got, want) {
		t.Errorf("ExposedRoles() = %v, want %v", got, want)
	}
	tb.AllowMeshPeer("chat", "b", false)
	if tb.PeerListedAny("b") {
		t.Errorf("PeerListedAny(b) after removal = true, want false")
	}
}

func TestProxyPort(t *testing.T) {
	env := newTestTable(t)
	if p, ok := env.t.ProxyPort("chat"); ok {
		t.Errorf("ProxyPort(chat) = %d, true; want unset", p)
	}
	env.t.SetProxyPort("chat", 18080)
	if p, ok := env.t.ProxyPort("chat"); !ok || p != 18080 {
		t.Errorf("ProxyPort(chat) = %d, %v; want 18080, true", p, ok)
	}
	env.t.SetProxyPort("chat", 0)
	if p, ok := env.t.ProxyPort("chat"); ok {
		t.Errorf("ProxyPort(chat) after clearing = %d, true; want unset", p)
	}
}
