package placement

import (
	"errors"
	"reflect"
	"testing"
)

func TestLocalForPeer(t *testing.T) {
	inst := Local{Base: "http://127.0.0.1:8081", Model: "llama-3-8b", API: "openai", Runtime: "llama.cpp"}
	full := func(env testEnv) {
		_ = env.t.RegisterLocal("chat", inst)
		env.t.ExposeToMesh("chat", true)
		env.t.AllowMeshPeer("chat", "b", true)
	}
	tests := []struct {
		name  string
		setup func(env testEnv)
		role  string
		peer  string
		want  Reason // "" = served
	}{
		{"served", full, "chat", "b", ""},
		{"not exposed", func(env testEnv) { full(env); env.t.ExposeToMesh("chat", false) }, "chat", "b", ReasonNotExposed},
		{"never exposed", func(env testEnv) {
			_ = env.t.RegisterLocal("chat", inst)
			env.t.AllowMeshPeer("chat", "b", true)
		}, "chat", "b", ReasonNotExposed},
		{"peer not on serve list", full, "chat", "c", ReasonNotOnServeList},
		{"peer removed from serve list", func(env testEnv) { full(env); env.t.AllowMeshPeer("chat", "b", false) }, "chat", "b", ReasonNotOnServeList},
		{"consumer allowlist is not a serve list", func(env testEnv) {
			_ = env.t.RegisterLocal("chat", inst)
			env.t.ExposeToMesh("chat", true)
			env.t.AllowRemoteNode("chat", "b", true)
		}, "chat", "b", ReasonNotOnServeList},
		{"served for another role only", func(env testEnv) {
			full(env)
			_ = env.t.RegisterLocal("embed", inst)
			env.t.ExposeToMesh("embed", true)
		}, "embed", "b", ReasonNotOnServeList},
		{"no local instance", func(env testEnv) { full(env); env.t.DeregisterLocal("chat") }, "chat", "b", ReasonNoLocal},
		{
			// The only instance of chat is remote (c): a peer's request must
			// never be bounced on to it.
			"remote only, no bouncing", func(env testEnv) {
				env.t.ExposeToMesh("chat", true)
				env.t.AllowMeshPeer("chat", "b", true)
				env.hear(t, "chat", "c", 0)
			}, "chat", "b", ReasonNoLocal,
		},
		{"peer revoked", func(env testEnv) { full(env); env.adm.set("b", "") }, "chat", "b", ReasonNotAdmitted},
		// Its connection proved who it is; gossip not listing it alive (a
		// restart it has not heard of yet) is no reason to refuse it.
		{"trusted peer not a live member is served", func(env testEnv) { full(env); env.adm.leave("b") }, "chat", "b", ""},
		{"consumer-scope peer is served", func(env testEnv) { full(env); env.adm.set("b", "consumer") }, "chat", "b", ""},
		{"peer is self", func(env testEnv) { full(env); env.t.AllowMeshPeer("chat", "a", true) }, "chat", "a", ReasonSelfNotPeer},
		{"empty peer", full, "chat", "", ReasonEmptyNode},
		{"bad role", full, "../chat", "b", ReasonBadRole},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			tt.setup(env)
			env.audit.take()

			got, ok := env.t.LocalForPeer(tt.role, tt.peer)
			events := env.audit.take()
			l, err := env.t.CheckPeer(tt.role, tt.peer)
			if tt.want == "" {
				if !ok || got != inst {
					t.Fatalf("LocalForPeer(%q, %q) = %+v, %v; want %+v, true", tt.role, tt.peer, got, ok, inst)
				}
				if err != nil || l != inst {
					t.Errorf("CheckPeer = %+v, %v; want %+v, nil", l, err, inst)
				}
				if len(events) != 0 {
					t.Errorf("audit events when served = %+v, want none", events)
				}
				return
			}
			if ok || got != (Local{}) {
				t.Errorf("LocalForPeer(%q, %q) = %+v, %v; want refused", tt.role, tt.peer, got, ok)
			}
			var re *RefusedError
			if !errors.As(err, &re) || re.Reason != tt.want || !errors.Is(err, ErrRefused) {
				t.Errorf("CheckPeer(%q, %q) = %v, want refusal %q", tt.role, tt.peer, err, tt.want)
			}
			want := []AuditEvent{{Kind: AuditPeerRefused, Role: tt.role, Node: tt.peer, Fields: map[string]string{"why": string(tt.want), "server": "a"}}}
			if !reflect.DeepEqual(events, want) {
				t.Errorf("audit events = %+v, want %+v", events, want)
			}
		})
	}
}

func TestLocalForPeerWithoutAdmission(t *testing.T) {
	tbl, err := New(Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	inst := Local{Base: "http://127.0.0.1:8081"}
	if err := tbl.RegisterLocal("chat", inst); err != nil {
		t.Fatal(err)
	}
	tbl.ExposeToMesh("chat", true)
	tbl.AllowMeshPeer("chat", "b", true)
	if got, ok := tbl.LocalForPeer("chat", "b"); !ok || got != inst {
		t.Errorf("LocalForPeer(chat, b) = %+v, %v; want %+v, true (policy alone decides without admission)", got, ok, inst)
	}
}

func TestAdvertisements(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	_ = tb.RegisterLocal("embed", Local{Base: "http://127.0.0.1:8082", Model: "e5", API: "openai", Runtime: "docker"})
	_ = tb.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081", Model: "llama", API: "openai", Runtime: "llama.cpp"})
	_ = tb.RegisterLocal("private", Local{Base: "http://127.0.0.1:8083"})
	tb.ExposeToMesh("embed", true)
	tb.ExposeToMesh("chat", true)
	tb.ExposeToMesh("remote-only", true) // exposed but not served here
	env.hear(t, "remote-only", "b", 0)
	tb.SetLocalLoad("chat", 3)

	tests := []struct {
		role string
		want Advert
		ok   bool
	}{
		{"chat", Advert{Name: "infer.chat", Node: "a", API: "openai", Runtime: "llama.cpp", Model: "llama", Load: 3, Methods: AdvertMethods()}, true},
		{"embed", Advert{Name: "infer.embed", Node: "a", API: "openai", Runtime: "docker", Model: "e5", Methods: AdvertMethods()}, true},
		{"private", Advert{}, false},
		{"remote-only", Advert{}, false},
		{"unknown", Advert{}, false},
	}
	for _, tt := range tests {
		got, ok := tb.Advertisement(tt.role)
		if ok != tt.ok || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("Advertisement(%q) = %+v, %v; want %+v, %v", tt.role, got, ok, tt.want, tt.ok)
		}
	}
	all := tb.Advertisements()
	if got, want := len(all), 2; got != want {
		t.Fatalf("Advertisements() = %+v, want %d", all, want)
	}
	if all[0].Name != "infer.chat" || all[1].Name != "infer.embed" {
		t.Errorf("Advertisements() names = %q, %q; want sorted infer.chat, infer.embed", all[0].Name, all[1].Name)
	}
	// Our own advert, looped back to us, is refused.
	if err := tb.IngestAdvertisement("a", all[0]); !errors.Is(err, ErrRefused) {
		t.Errorf("IngestAdvertisement(own advert) = %v, want refused", err)
	}
	// Deregistering stops advertising and forgets the load.
	tb.DeregisterLocal("chat")
	if _, ok := tb.Advertisement("chat"); ok {
		t.Errorf("Advertisement(chat) after deregister: ok = true, want false")
	}
	_ = tb.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081"})
	if ad, _ := tb.Advertisement("chat"); ad.Load != 0 {
		t.Errorf("Advertisement(chat).Load after re-register = %d, want 0", ad.Load)
	}
	// Unexposing stops advertising.
	tb.ExposeToMesh("embed", false)
	if _, ok := tb.Advertisement("embed"); ok {
		t.Errorf("Advertisement(embed) after unexpose: ok = true, want false")
	}
}

func TestBaseURLs(t *testing.T) {
	tests := []struct {
		name      string
		setup     func(env testEnv)
		wantBase  string // BaseURLForRole, "" = none
		wantLocal string // LocalBaseForRole, "" = none
	}{
		{"nothing", func(testEnv) {}, "", ""},
		{"local", func(env testEnv) {
			_ = env.t.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081/"})
			env.t.SetProxyPort("chat", 18080)
		}, "http://127.0.0.1:8081/v1", "http://127.0.0.1:8081/v1"},
		{"local ipv6", func(env testEnv) {
			_ = env.t.RegisterLocal("chat", Local{Base: "http://[::1]:8081"})
		}, "http://[::1]:8081/v1", "http://[::1]:8081/v1"},
		{"local preferred over remote", func(env testEnv) {
			_ = env.t.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081"})
			env.hear(t, "chat", "b", 0)
			env.t.SetProxyPort("chat", 18080)
		}, "http://127.0.0.1:8081/v1", "http://127.0.0.1:8081/v1"},
		{"remote via proxy", func(env testEnv) {
			env.hear(t, "chat", "b", 0)
			env.t.SetProxyPort("chat", 18080)
		}, "http://127.0.0.1:18080/v1", ""},
		{"remote without proxy port", func(env testEnv) {
			env.hear(t, "chat", "b", 0)
			env.t.SetProxyPort("embed", 18081)
		}, "", ""},
		{"proxy port but nothing serves", func(env testEnv) {
			env.t.SetProxyPort("chat", 18080)
		}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestTable(t)
			tt.setup(env)
			got, ok := env.t.BaseURLForRole("chat")
			if ok != (tt.wantBase != "") || got != tt.wantBase {
				t.Errorf("BaseURLForRole(chat) = %q, %v; want %q", got, ok, tt.wantBase)
			}
			got, ok = env.t.LocalBaseForRole("chat")
			if ok != (tt.wantLocal != "") || got != tt.wantLocal {
				t.Errorf("LocalBaseForRole(chat) = %q, %v; want %q", got, ok, tt.wantLocal)
			}
		})
	}
}
