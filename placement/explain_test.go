package placement

import (
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"
)

func TestExplain(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	env.adm.set("e", "full")
	env.adm.set("f", "full")
	env.adm.set("g", "full")
	_ = tb.RegisterLocal("chat", Local{Base: "http://127.0.0.1:8081", Model: "lm"})
	tb.SetLocalLoad("chat", 9)
	env.hear(t, "chat", "b", 4)           // candidate
	env.hear(t, "chat", "c", 1)           // candidate, less loaded
	env.hear(t, "chat", "d", 0)           // will be revoked
	env.hear(t, "chat", "e", 0)           // will be downgraded to consumer scope
	env.hear(t, "chat", "f", 0)           // will go stale
	env.hear(t, "chat", "g", 0)           // will be un-allowlisted
	tb.AllowRemoteNode("chat", "h", true) // allowlisted, never advertised
	tb.AllowRemoteNode("chat", "a", true) // self on the list: not shown as remote
	tb.AllowRemoteNode("embed", "i", true)

	env.clock.Advance(30 * time.Second)
	for _, n := range []string{"b", "c", "d", "e", "g"} {
		if err := tb.IngestAdvertisement(n, advert("chat", n, map[string]uint32{"b": 4, "c": 1}[n])); err != nil {
			t.Fatalf("refresh %s: %v", n, err)
		}
	}
	env.clock.Advance(31 * time.Second) // f is 61s old
	env.adm.set("d", "")
	env.adm.set("e", "consumer")
	tb.AllowRemoteNode("chat", "g", false)

	got := tb.Explain("chat")
	want := []Decision{
		{Node: "a", Kind: KindLocal, Candidate: true, Rank: 0, Base: "http://127.0.0.1:8081", Model: "lm", Load: 9},
		{Node: "c", Kind: KindRemote, Candidate: true, Rank: 1, Model: "m-c", Load: 1, HasAdvert: true, Age: 31 * time.Second},
		{Node: "b", Kind: KindRemote, Candidate: true, Rank: 2, Model: "m-b", Load: 4, HasAdvert: true, Age: 31 * time.Second},
		{Node: "d", Kind: KindRemote, Rank: -1, Reasons: []Reason{ReasonNotAdmitted}, Model: "m-d", HasAdvert: true, Age: 31 * time.Second},
		{Node: "e", Kind: KindRemote, Rank: -1, Reasons: []Reason{ReasonMayNotServe}, Model: "m-e", HasAdvert: true, Age: 31 * time.Second},
		{Node: "f", Kind: KindRemote, Rank: -1, Reasons: []Reason{ReasonStale}, Model: "m-f", HasAdvert: true, Age: 61 * time.Second},
		{Node: "g", Kind: KindRemote, Rank: -1, Reasons: []Reason{ReasonNotAllowlisted}, Model: "m-g", HasAdvert: true, Age: 31 * time.Second},
		{Node: "h", Kind: KindRemote, Rank: -1, Reasons: []Reason{ReasonNoAdvert, ReasonNotAdmitted}},
	}
	if len(got) != len(want) {
		t.Fatalf("Explain(chat) = %d decisions, want %d:\n%+v", len(got), len(want), got)
	}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Errorf("Explain(chat)[%d] =\n %+v\nwant\n %+v", i, got[i], want[i])
		}
	}
	// Explain's candidates are exactly Resolve's list, in order.
	var cands []string
	for _, d := range got {
		if d.Candidate {
			cands = append(cands, d.Node)
		}
	}
	if r := nodes(tb.Resolve("chat")); !reflect.DeepEqual(cands, r) {
		t.Errorf("Explain candidates %v != Resolve %v", cands, r)
	}
}

func TestExplainReasonsCombine(t *testing.T) {
	env := newTestTable(t)
	env.hear(t, "chat", "b", 0)
	env.clock.Advance(2 * time.Minute)
	env.adm.set("b", "")
	env.t.AllowRemoteNode("chat", "b", false)
	got := env.t.Explain("chat")
	want := []Reason{ReasonNotAllowlisted, ReasonStale, ReasonNotAdmitted}
	if len(got) != 1 || !reflect.DeepEqual(got[0].Reasons, want) {
		t.Errorf("Explain(chat) = %+v, want one decision with reasons %v", got, want)
	}

	noMesh, err := New(Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	noMesh.AllowRemoteNode("chat", "b", true)
	got = noMesh.Explain("chat")
	want = []Reason{ReasonNoAdvert, ReasonNoMesh}
	if len(got) != 1 || !reflect.DeepEqual(got[0].Reasons, want) {
		t.Errorf("Explain(chat) without mesh = %+v, want reasons %v", got, want)
	}
	if got := noMesh.Explain("embed"); len(got) != 0 {
		t.Errorf("Explain(embed) on an unknown role = %+v, want empty", got)
	}
}

func TestSnapshot(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	l := Local{Base: "http://127.0.0.1:8081", Model: "lm", API: "openai", Runtime: "demo"}
	_ = tb.RegisterLocal("chat", l)
	tb.SetLocalLoad("chat", 2)
	tb.SetLocalCapacity("chat", Capacity{Slots: 4, Running: 2, Waiting: 1, KVUsage: 0.5})
	tb.ExposeToMesh("chat", true)
	tb.AllowMeshPeer("chat", "c", true)
	tb.AllowMeshPeer("chat", "b", true)
	tb.SetProxyPort("chat", 18080)
	env.hear(t, "embed", "c", 1)
	recv := env.clock.Now()
	env.clock.Advance(10 * time.Second)
	env.hear(t, "chat", "b", 0)
	env.clock.Advance(5 * time.Second)

	s := tb.Snapshot()
	want := Snapshot{
		NodeID:     "a",
		Generation: tb.Generation(),
		AdvertTTL:  time.Minute,
		Locals:     map[string]Local{"chat": l},
		LocalLoad:  map[string]uint32{"chat": 2},
		LocalCap:   map[string]Capacity{"chat": {Slots: 4, Running: 2, Waiting: 1, KVUsage: 0.5}},
		Remotes: []RemoteEntry{
			{Role: "chat", Node: "b", Advert: advert("chat", "b", 0), ReceivedAt: recv.Add(10 * time.Second), Age: 5 * time.Second, Fresh: true},
			{Role: "embed", Node: "c", Advert: advert("embed", "c", 1), ReceivedAt: recv, Age: 15 * time.Second, Fresh: true},
		},
		Allow:      map[string][]string{"chat": {"b"}, "embed": {"c"}},
		Serve:      map[string][]string{"chat": {"b", "c"}},
		Exposed:    []string{"chat"},
		ProxyPorts: map[string]uint16{"chat": 18080},
	}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("Snapshot() =\n%+v\nwant\n%+v", s, want)
	}
	// A deep copy: mutating it changes nothing in the table.
	s.Locals["chat"] = Local{}
	s.Allow["chat"][0] = "zz"
	s.Serve["chat"] = nil
	s.Remotes[0].Advert.Methods[0] = "zz"
	s.Exposed[0] = "zz"
	s.ProxyPorts["chat"] = 1
	s.LocalCap["chat"] = Capacity{}
	if again := tb.Snapshot(); !reflect.DeepEqual(again, want) {
		t.Errorf("Snapshot() after mutating a previous one =\n%+v\nwant\n%+v", again, want)
	}
}

// TestConcurrentUse hammers every method from several goroutines; run
// under -race it proves the locking, and the invariants checked at the end
// prove nothing was lost.
func TestConcurrentUse(t *testing.T) {
	env := newTestTable(t)
	tb := env.t
	const workers, iters = 6, 300
	peers := []string{"b", "c", "d"}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range iters {
				role := fmt.Sprintf("r%d", i%4)
				peer := peers[(w+i)%len(peers)]
				switch (w + i) % 12 {
				case 0:
					_ = tb.RegisterLocal(role, Local{Base: fmt.Sprintf("http://127.0.0.1:%d", 8000+i%3)})
				case 1:
					tb.DeregisterLocal(role)
				case 2:
					tb.AllowRemoteNode(role, peer, i%5 != 0)
				case 3:
					tb.AllowMeshPeer(role, peer, i%3 != 0)
				case 4:
					tb.ExposeToMesh(role, i%2 == 0)
				case 5:
					_ = tb.IngestAdvertisement(peer, advert(role, peer, uint32(i%7)))
				case 6:
					tb.Withdraw(role, peer)
				case 7:
					env.clock.Advance(time.Second)
					tb.ExpireStale()
				case 8:
					tb.Resolve(role)
					tb.Explain(role)
				case 9:
					tb.LocalForPeer(role, peer)
					tb.BaseURLForRole(role)
				case 10:
					tb.Snapshot()
					tb.Advertisements()
					tb.SetLocalLoad(role, uint32(i))
				case 11:
					if i%50 == 0 {
						tb.RemoveNode(peer)
						env.adm.set(peer, "full")
					}
					<-closedOrNil(tb.Changed())
					tb.SetProxyPort(role, uint16(18000+i%2))
				}
			}
		}()
	}
	wg.Wait()

	// Invariants after the storm: every Resolve list is ordered, local
	// first, and Changed still works.
	for r := range 4 {
		role := fmt.Sprintf("r%d", r)
		c := tb.Resolve(role)
		for i, x := range c {
			if x.Kind == KindLocal && i != 0 {
				t.Errorf("Resolve(%s)[%d] is local, want local only first: %+v", role, i, c)
			}
			if i > 0 && x.Kind == KindRemote && c[i-1].Kind == KindRemote &&
				(c[i-1].Load > x.Load || c[i-1].Load == x.Load && c[i-1].Node >= x.Node) {
				t.Errorf("Resolve(%s) not ordered by load then node: %+v", role, c)
			}
		}
	}
	ch := tb.Changed()
	tb.ExposeToMesh("final", true)
	if !closed(ch) {
		t.Errorf("Changed() not closed after a change following concurrent use")
	}
}

// closedOrNil returns a channel that is ready at once, so the worker
// touches Changed() without waiting on it.
func closedOrNil(ch <-chan struct{}) <-chan struct{} {
	select {
	case <-ch:
		return ch
	default:
		c := make(chan struct{})
		close(c)
		return c
	}
}
