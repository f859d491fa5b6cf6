package placement

import (
	"errors"
	"reflect"
	"testing"
	"time"
)

func TestIngestAdvertisementRefusals(t *testing.T) {
	tests := []struct {
		name     string
		noMesh   bool
		sender   string
		ad       Advert
		setup    func(env testEnv)
		want     Reason // "" = heard
		wantRole string // role in the error and audit event
	}{
		{name: "heard", sender: "b", ad: advert("chat", "b", 0), want: "", wantRole: "chat"},
		{name: "no prefix", sender: "b", ad: Advert{Name: "chat", Node: "b"}, want: ReasonBadName, wantRole: "chat"},
		{name: "other prefix", sender: "b", ad: Advert{Name: "svc.chat", Node: "b"}, want: ReasonBadName, wantRole: "svc.chat"},
		{name: "empty role", sender: "b", ad: Advert{Name: "infer.", Node: "b"}, want: ReasonBadRole, wantRole: "infer."},
		{name: "role with slash", sender: "b", ad: Advert{Name: "infer.a/b", Node: "b"}, want: ReasonBadRole, wantRole: "a/b"},
		{name: "dotdot role", sender: "b", ad: Advert{Name: "infer...", Node: "b"}, want: ReasonBadRole, wantRole: ".."},
		{name: "empty sender", sender: "", ad: advert("chat", "", 0), want: ReasonBadSender, wantRole: "chat"},
		{name: "from self", sender: "a", ad: advert("chat", "a", 0), want: ReasonFromSelf, wantRole: "chat"},
		{name: "relayed advert of another node", sender: "b", ad: advert("chat", "c", 0), want: ReasonNotOwnAdvert, wantRole: "chat"},
		{name: "advert naming no node", sender: "b", ad: advert("chat", "", 0), want: ReasonNotOwnAdvert, wantRole: "chat"},
		{name: "no mesh", noMesh: true, sender: "b", ad: advert("chat", "b", 0), want: ReasonNoMesh, wantRole: "chat"},
		{name: "not admitted", sender: "x", ad: advert("chat", "x", 0), want: ReasonNotAdmitted, wantRole: "chat"},
		{
			name: "revoked", sender: "b", ad: advert("chat", "b", 0),
			setup: func(env testEnv) { env.adm.set("b", "") },
			want:  ReasonNotAdmitted, wantRole: "chat",
		},
		{
			name: "consumer scope", sender: "b", ad: advert("chat", "b", 0),
			setup: func(env testEnv) { env.adm.set("b", "consumer") },
			want:  ReasonMayNotServe, wantRole: "chat",
		},
		{
			name: "not allowlisted", sender: "b", ad: advert("chat", "b", 0),
			setup: func(env testEnv) { env.t.AllowRemoteNode("chat", "b", false) },
			want:  ReasonNotAllowlisted, wantRole: "chat",
		},
		{
			name: "allowlisted for another role only", sender: "b", ad: advert("embed", "b", 0),
			want: ReasonNotAllowlisted, wantRole: "embed",
		},
		{
			name: "another node allowlisted", sender: "c", ad: advert("chat", "c", 0),
			want: ReasonNotAllowlisted, wantRole: "chat",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			if tt.noMesh {
				tbl, err := New(Config{NodeID: "a", Audit: env.audit, Now: env.clock.Now})
				if err != nil {
					t.Fatal(err)
				}
				env.t = tbl
			}
			env.t.AllowRemoteNode("chat", "b", true) // b may serve chat to us
			if tt.setup != nil {
				tt.setup(env)
			}
			env.audit.take()
			gen := env.t.Generation()

			err := env.t.IngestAdvertisement(tt.sender, tt.ad)
			events := env.audit.take()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("IngestAdvertisement = %v, want nil", err)
				}
				if len(events) != 0 {
					t.Errorf("audit events for a heard advert = %+v, want none", events)
				}
				if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{tt.sender}) {
					t.Errorf("Resolve(chat) nodes = %v, want [%s]", got, tt.sender)
				}
				return
			}
			var re *RefusedError
			if !errors.As(err, &re) {
				t.Fatalf("IngestAdvertisement = %v, want *RefusedError", err)
			}
			if !errors.Is(err, ErrRefused) {
				t.Errorf("errors.Is(%v, ErrRefused) = false, want true", err)
			}
			if re.Reason != tt.want || re.Role != tt.wantRole || re.Node != tt.sender {
				t.Errorf("refusal = %+v, want reason %q role %q node %q", *re, tt.want, tt.wantRole, tt.sender)
			}
			want := []AuditEvent{{
				Kind: AuditAdvertRefused, Role: tt.wantRole, Node: tt.sender,
				Fields: map[string]string{"why": string(tt.want), "name": tt.ad.Name, "advertised_node": tt.ad.Node, "consumer": "a"},
			}}
			if !reflect.DeepEqual(events, want) {
				t.Errorf("audit events = %+v, want %+v", events, want)
			}
			if got := env.t.Generation(); got != gen {
				t.Errorf("Generation() after refusal = %d, want %d", got, gen)
			}
			if len(env.t.Snapshot().Remotes) != 0 {
				t.Errorf("refused advert was stored: %+v", env.t.Snapshot().Remotes)
			}
		})
	}
}

func TestIngestCopiesMethods(t *testing.T) {
	env := newTestTable(t)
	ad := advert("chat", "b", 0)
	env.hear(t, "chat", "b", 0)
	_ = env.t.IngestAdvertisement("b", ad)
	ad.Methods[0] = "mutated"
	if got := env.t.Snapshot().Remotes[0].Advert.Methods[0]; got != "chat.completions" {
		t.Errorf("stored Methods[0] = %q after caller mutation, want chat.completions", got)
	}
}

func TestResolveOrdering(t *testing.T) {
	tests := []struct {
		name      string
		local     bool
		adverts   map[string]uint32 // node -> load
		wantNodes []string
	}{
		{"nothing", false, nil, nil},
		{"local only", true, nil, []string{"a"}},
		{"remote only", false, map[string]uint32{"b": 0}, []string{"b"}},
		{"local first despite load", true, map[string]uint32{"b": 0, "c": 0}, []string{"a", "b", "c"}},
		{"least loaded first", false, map[string]uint32{"b": 5, "c": 1, "d": 3}, []string{"c", "d", "b"}},
		{"ties by node id", false, map[string]uint32{"d": 2, "c": 2, "b": 2}, []string{"b", "c", "d"}},
		{"mixed", true, map[string]uint32{"d": 0, "c": 4, "b": 4}, []string{"a", "d", "b", "c"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			if tt.local {
				if err := env.t.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081", Model: "lm"}); err != nil {
					t.Fatal(err)
				}
			}
			for n, load := range tt.adverts {
				env.hear(t, "chat", n, load)
			}
			got := env.t.Resolve("chat")
			if !reflect.DeepEqual(nodes(got), tt.wantNodes) {
				t.Fatalf("Resolve(chat) nodes = %v, want %v", nodes(got), tt.wantNodes)
			}
			if tt.wantNodes == nil && got != nil {
				t.Errorf("Resolve(chat) = %#v, want nil", got)
			}
			for i, c := range got {
				if c.Node == "a" {
					want := Candidate{Kind: KindLocal, Node: "a", Base: "http://127.0.0.1:8081", Model: "lm"}
					if c != want || i != 0 {
						t.Errorf("Resolve(chat)[%d] = %+v, want %+v at 0", i, c, want)
					}
					continue
				}
				want := Candidate{Kind: KindRemote, Node: c.Node, Model: "m-" + c.Node, Load: tt.adverts[c.Node], LoadSeq: c.LoadSeq}
				if c != want || c.LoadSeq == 0 {
					t.Errorf("Resolve(chat)[%d] = %+v, want %+v", i, c, want)
				}
			}
			if other := env.t.Resolve("embed"); other != nil {
				t.Errorf("Resolve(embed) = %+v, want nil", other)
			}
		})
	}
}

// TestResolveExclusions: b, c and d advertise chat; each case breaks one
// rule for b and checks that b (only) drops out, at once.
func TestResolveExclusions(t *testing.T) {
	tests := []struct {
		name   string
		break_ func(env testEnv)
		want   []string
	}{
		{"baseline", func(testEnv) {}, []string{"b", "c", "d"}},
		{"consumer allowlist revoked", func(env testEnv) { env.t.AllowRemoteNode("chat", "b", false) }, []string{"c", "d"}},
		{"admission revoked", func(env testEnv) { env.adm.set("b", "") }, []string{"c", "d"}},
		{"scope downgraded to consumer", func(env testEnv) { env.adm.set("b", "consumer") }, []string{"c", "d"}},
		{"withdrawn", func(env testEnv) { env.t.Withdraw("chat", "b") }, []string{"c", "d"}},
		{"withdrawn other role", func(env testEnv) { env.t.Withdraw("embed", "b") }, []string{"b", "c", "d"}},
		{"node removed", func(env testEnv) { env.t.RemoveNode("b") }, []string{"c", "d"}},
		{"all revoked", func(env testEnv) {
			for _, n := range []string{"b", "c", "d"} {
				env.adm.set(n, "")
			}
		}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			for _, n := range []string{"b", "c", "d"} {
				env.hear(t, "chat", n, 0)
				env.hear(t, "embed", n, 0)
			}
			tt.break_(env)
			if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Resolve(chat) nodes = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestResolveBadRole(t *testing.T) {
	env := newTestTable(t)
	for _, r := range []string{"", "a/b", ".."} {
		if got := env.t.Resolve(r); got != nil {
			t.Errorf("Resolve(%q) = %+v, want nil", r, got)
		}
		if got := env.t.Explain(r); got != nil {
			t.Errorf("Explain(%q) = %+v, want nil", r, got)
		}
	}
}

func TestRemoveNodeAllRoles(t *testing.T) {
	env := newTestTable(t)
	env.hear(t, "chat", "b", 0)
	env.hear(t, "embed", "b", 0)
	env.hear(t, "chat", "c", 0)
	env.t.RemoveNode("b")
	if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{"c"}) {
		t.Errorf("Resolve(chat) after RemoveNode(b) = %v, want [c]", got)
	}
	if got := env.t.Resolve("embed"); got != nil {
		t.Errorf("Resolve(embed) after RemoveNode(b) = %+v, want nil", got)
	}
	// Policy survives: the node may come back and be heard again.
	if !env.t.RemoteNodeAllowed("chat", "b") {
		t.Errorf("RemoteNodeAllowed(chat, b) after RemoveNode = false, want true (policy kept)")
	}
	if err := env.t.IngestAdvertisement("b", advert("chat", "b", 0)); err != nil {
		t.Errorf("IngestAdvertisement after RemoveNode = %v, want nil", err)
	}
}

func TestAdvertTTL(t *testing.T) {
	tests := []struct {
		name    string
		steps   []time.Duration // advance, then re-advertise, for all but the last
		advance time.Duration   // final advance before Resolve
		want    bool
	}{
		{"just received", nil, 0, true},
		{"at ttl", nil, time.Minute, true},
		{"past ttl", nil, time.Minute + time.Nanosecond, false},
		{"refreshed by repeat", []time.Duration{50 * time.Second}, 50 * time.Second, true},
		{"refreshed then expired", []time.Duration{50 * time.Second}, 61 * time.Second, false},
		{"revived after expiry", []time.Duration{2 * time.Minute}, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			env.hear(t, "chat", "b", 0)
			for _, d := range tt.steps {
				env.clock.Advance(d)
				if err := env.t.IngestAdvertisement("b", advert("chat", "b", 0)); err != nil {
					t.Fatal(err)
				}
			}
			env.clock.Advance(tt.advance)
			got := len(env.t.Resolve("chat")) == 1
			if got != tt.want {
				t.Errorf("b resolves = %v, want %v", got, tt.want)
			}
			snap := env.t.Snapshot()
			if len(snap.Remotes) != 1 || snap.Remotes[0].Fresh != tt.want || snap.Remotes[0].Age != tt.advance {
				t.Errorf("Snapshot().Remotes = %+v, want one entry, Fresh %v, Age %v", snap.Remotes, tt.want, tt.advance)
			}
		})
	}
}

// TestFreshnessFromReceipt: nothing in an advert can extend its life; only
// our receipt of it does. A clock that jumps back does not expire entries.
func TestFreshnessFromReceipt(t *testing.T) {
	env := newTestTable(t)
	env.hear(t, "chat", "b", 0)
	env.clock.Advance(-time.Hour)
	if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{"b"}) {
		t.Errorf("Resolve after clock went back = %v, want [b]", got)
	}
}

func TestExpireStaleAndNextExpiry(t *testing.T) {
	env := newTestTable(t)
	if _, ok := env.t.NextExpiry(); ok {
		t.Errorf("NextExpiry() on empty table: ok = true, want false")
	}
	start := env.clock.Now()
	env.hear(t, "chat", "b", 0)
	env.clock.Advance(20 * time.Second)
	env.hear(t, "chat", "c", 0)
	env.hear(t, "embed", "c", 0)

	if next, ok := env.t.NextExpiry(); !ok || !next.Equal(start.Add(time.Minute)) {
		t.Errorf("NextExpiry() = %v, %v; want %v, true", next, ok, start.Add(time.Minute))
	}
	if n := env.t.ExpireStale(); n != 0 {
		t.Errorf("ExpireStale() before expiry = %d, want 0", n)
	}
	env.clock.Advance(41 * time.Second) // b is 61s old, c 41s
	ch := env.t.Changed()
	if n := env.t.ExpireStale(); n != 1 {
		t.Errorf("ExpireStale() = %d, want 1", n)
	}
	if !closed(ch) {
		t.Errorf("Changed() not closed by ExpireStale")
	}
	if next, ok := env.t.NextExpiry(); !ok || !next.Equal(start.Add(80*time.Second)) {
		t.Errorf("NextExpiry() = %v, %v; want %v, true", next, ok, start.Add(80*time.Second))
	}
	if got := len(env.t.Snapshot().Remotes); got != 2 {
		t.Errorf("Remotes after expiry = %d, want 2", got)
	}
	env.clock.Advance(time.Minute)
	if n := env.t.ExpireStale(); n != 2 {
		t.Errorf("ExpireStale() = %d, want 2", n)
	}
	if _, ok := env.t.NextExpiry(); ok {
		t.Errorf("NextExpiry() after everything expired: ok = true, want false")
	}
}

func TestRevocationTakesEffectAtOnce(t *testing.T) {
	env := newTestTable(t)
	env.hear(t, "chat", "b", 0)
	env.t.SetProxyPort("chat", 18080)
	if got, ok := env.t.BaseURLForRole("chat"); !ok || got != "http://127.0.0.1:18080/v1" {
		t.Fatalf("BaseURLForRole(chat) = %q, %v; want proxy base", got, ok)
	}
	gen := env.t.Generation()
	env.adm.set("b", "") // revoked in the mesh; the table has not been told
	if got := env.t.Resolve("chat"); got != nil {
		t.Errorf("Resolve(chat) right after revocation = %+v, want nil", got)
	}
	if got, ok := env.t.BaseURLForRole("chat"); ok {
		t.Errorf("BaseURLForRole(chat) right after revocation = %q, want none", got)
	}
	if got := env.t.Generation(); got != gen {
		t.Errorf("Generation() = %d, want %d (admission is re-checked, not cached)", got, gen)
	}
	env.adm.set("b", "full") // re-admitted: its still-fresh advert counts again
	if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{"b"}) {
		t.Errorf("Resolve(chat) after re-admission = %v, want [b]", got)
	}
}

func TestNoMeshResolvesLocalOnly(t *testing.T) {
	tbl, err := New(Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	tbl.AllowRemoteNode("chat", "b", true)
	if err := tbl.IngestAdvertisement("b", advert("chat", "b", 0)); !errors.Is(err, ErrRefused) {
		t.Errorf("IngestAdvertisement without mesh = %v, want refused", err)
	}
	if err := tbl.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081"}); err != nil {
		t.Fatal(err)
	}
	if got := nodes(tbl.Resolve("chat")); !reflect.DeepEqual(got, []string{"a"}) {
		t.Errorf("Resolve(chat) = %v, want [a]", got)
	}
}

// A load report from a peer's answer reorders candidates at once, lasts
// until the peer's next advert, never makes an advert fresher or revives an
// expired one, leaves the generation alone, and is dropped for a node whose
// advert is not held.
func TestReportLoad(t *testing.T) {
	env := newTestTable(t)
	env.hear(t, "chat", "b", 0)
	env.hear(t, "chat", "c", 1)
	gen := env.t.Generation()
	if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{"b", "c"}) {
		t.Fatalf("before: %v", got)
	}
	seq0 := env.t.Resolve("chat")[0].LoadSeq
	c := Capacity{Slots: 4, Running: 4, Waiting: 3, KVUsage: 0.9}
	seq := env.t.ReportLoad("chat", "b", 5, c)
	if seq == 0 || seq == seq0 {
		t.Fatalf("ReportLoad(b): seq %d (the advert's %d), want a new one", seq, seq0)
	}
	got := env.t.Resolve("chat")
	if !reflect.DeepEqual(nodes(got), []string{"c", "b"}) || got[1].Load != 5 || got[1].Capacity != c || got[1].LoadSeq != seq {
		t.Fatalf("after b's report: %+v, want c then b with load 5, %+v and seq %d", got, c, seq)
	}
	if env.t.Generation() != gen {
		t.Errorf("generation moved %d -> %d", gen, env.t.Generation())
	}
	if env.t.ReportLoad("chat", "d", 0, Capacity{}) != 0 || env.t.ReportLoad("embed", "b", 0, Capacity{}) != 0 {
		t.Error("a report for an advert not held was taken")
	}
	if got := nodes(env.t.Resolve("chat")); !reflect.DeepEqual(got, []string{"c", "b"}) {
		t.Errorf("a report for d or embed changed chat: %v", got)
	}
	// The next advert replaces the report.
	env.clock.Advance(time.Second)
	env.hear(t, "chat", "b", 0)
	got = env.t.Resolve("chat")
	if !reflect.DeepEqual(nodes(got), []string{"b", "c"}) || got[0].Capacity != (Capacity{}) || got[0].LoadSeq <= seq {
		t.Errorf("after b's next advert: %+v, want its load under a new seq", got)
	}
	// A repeat of the same advert leaves the seq: nothing new was said.
	seq = got[0].LoadSeq
	env.hear(t, "chat", "b", 0)
	if got := env.t.Resolve("chat"); got[0].LoadSeq != seq {
		t.Errorf("a repeated advert moved the seq %d -> %d", seq, got[0].LoadSeq)
	}
	// Freshness comes from adverts only.
	env.clock.Advance(50 * time.Second)
	env.t.ReportLoad("chat", "b", 0, Capacity{})
	env.clock.Advance(11 * time.Second)
	if got := nodes(env.t.Resolve("chat")); len(got) != 0 {
		t.Errorf("61s after the adverts, with a report at 51s: %v, want none", got)
	}
}
