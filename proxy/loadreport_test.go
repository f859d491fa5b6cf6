package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/infermesh/infermesh/placement"
)

func TestLoadReportRoundTrip(t *testing.T) {
	for _, r := range []LoadReport{
		{},
		{Load: 7},
		{Load: 3, Capacity: placement.Capacity{Slots: 4, Running: 2, Waiting: 1, KVUsage: 0.42}},
		{Load: 3, Capacity: placement.Capacity{Slots: 4, Running: 2, KVUsage: 0.5, CacheTokens: 16384}},
		{Load: 1<<32 - 1, Capacity: placement.Capacity{Slots: 1<<32 - 1, KVUsage: 1}},
		{Load: 2, Capacity: placement.Capacity{Slots: 4, Running: 2, CacheHit: 0.73, HasCacheHit: true}},
		{Load: 2, Capacity: placement.Capacity{Slots: 4, HasCacheHit: true}}, // a ratio of 0 is one
	} {
		got, ok := ParseLoadReport(r.String())
		if !ok || got != r {
			t.Errorf("ParseLoadReport(%q) = %+v, %v; want %+v", r.String(), got, ok, r)
		}
	}
}

// A peer's header is bounded and checked: a report without a load, with a
// count that is not a 32-bit number, or with a KV share that is not a
// number is dropped whole; a KV share outside 0..1 is clamped; unknown keys
// (a later version's) are ignored.
func TestParseLoadReportHostile(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want LoadReport
		ok   bool
	}{
		{"load=2", LoadReport{Load: 2}, true},
		{" load=2 ,slots=4, kv=0.5 ", LoadReport{Load: 2, Capacity: placement.Capacity{Slots: 4, KVUsage: 0.5}}, true},
		{"slots=4, load=2, future=x, ttft=12", LoadReport{Load: 2, Capacity: placement.Capacity{Slots: 4}}, true},
		{"load=1, kv=9", LoadReport{Load: 1, Capacity: placement.Capacity{KVUsage: 1}}, true},
		{"load=1, kv=-9", LoadReport{Load: 1}, true},
		{"load=1, hit=0.734", LoadReport{Load: 1, Capacity: placement.Capacity{CacheHit: 0.73, HasCacheHit: true}}, true},
		{"load=1, hit=3", LoadReport{Load: 1, Capacity: placement.Capacity{CacheHit: 1, HasCacheHit: true}}, true},
		{"load=1, hit=-1", LoadReport{Load: 1, Capacity: placement.Capacity{HasCacheHit: true}}, true},
		{"load=1, hit=NaN", LoadReport{}, false},
		{"", LoadReport{}, false},
		{"slots=4", LoadReport{}, false},
		{"load=-1", LoadReport{}, false},
		{"load=4294967296", LoadReport{}, false},
		{"load=1, waiting=99999999999", LoadReport{}, false},
		{"load=1, kv=NaN", LoadReport{}, false},
		{"load=1, kv=zz", LoadReport{}, false},
		{"load", LoadReport{}, false},
		{"load=1,,", LoadReport{}, false},
	} {
		got, ok := ParseLoadReport(tt.in)
		if ok != tt.ok || got != tt.want {
			t.Errorf("ParseLoadReport(%q) = %+v, %v; want %+v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func FuzzParseLoadReport(f *testing.F) {
	for _, s := range []string{"load=3, slots=4, running=2, waiting=1, kv=0.420", "load=0", "kv=1e400", "load=1,kv=-0", "load=1, hit=0.5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, ok := ParseLoadReport(s)
		if !ok {
			return
		}
		if k := r.Capacity.KVUsage; !(k >= 0 && k <= 1) {
			t.Fatalf("%q: KV share %v outside 0..1", s, k)
		}
		if h := r.Capacity.CacheHit; !(h >= 0 && h <= 1) || (h != 0 && !r.Capacity.HasCacheHit) {
			t.Fatalf("%q: cache hit ratio %v (known %v) outside 0..1", s, h, r.Capacity.HasCacheHit)
		}
		// What is read is what would be sent, up to the KV share's three
		// decimals.
		again, ok := ParseLoadReport(r.String())
		if !ok || again.Load != r.Load || again.Capacity.Slots != r.Capacity.Slots || again.Capacity.Waiting != r.Capacity.Waiting ||
			again.Capacity.CacheHit != r.Capacity.CacheHit || again.Capacity.HasCacheHit != r.Capacity.HasCacheHit {
			t.Fatalf("%q: read %+v, its String %q reads %+v, %v", s, r, r.String(), again, ok)
		}
	})
}

// The serving agent's answer to a peer carries its load report, taken while
// the request is still in flight at its instance (so it counts itself); the
// consumer hands it to OnLoadReport before relaying, and the app never sees
// the header. An app on the serving node gets no report.
func TestLoadReportRidesThePeersAnswer(t *testing.T) {
	table, _ := placement.New(placement.Config{NodeID: "b"})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[]}`)
	}))
	defer up.Close()
	if err := table.RegisterLocal("chat", placement.Local{Base: up.URL, Model: "m"}); err != nil {
		t.Fatal(err)
	}
	table.ExposeToMesh("chat", true)
	table.AllowMeshPeer("chat", "a", true)
	capB := placement.Capacity{Slots: 4, Running: 1, Waiting: 2, KVUsage: 0.25}
	var b *Proxy
	b, err := New(Config{Resolver: table, Peers: table, LoadReport: func(role string) LoadReport {
		return LoadReport{Load: uint32(b.LocalInFlight(role)), Capacity: capB}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Shutdown(context.Background())
	peerSrv := httptest.NewServer(b.PeerHandler(func(*http.Request) (string, bool) { return "a", true }, nil))
	defer peerSrv.Close()

	var mu sync.Mutex
	var got []string
	var reports []LoadReport
	e := newEnv(t, Config{
		Resolver: fakeResolver{{Kind: placement.KindRemote, Node: "b", Model: "m"}},
		Remote:   loopRemote{"b": peerSrv.URL},
		OnLoadReport: func(role, node string, r LoadReport) uint64 {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, role+"/"+node)
			reports = append(reports, r)
			return uint64(len(got))
		},
	})
	resp, err := http.Post(e.url+pathChat, "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if v := resp.Header.Get(LoadHeader); v != "" {
		t.Errorf("the app got the peer's %s: %q", LoadHeader, v)
	}
	mu.Lock()
	defer mu.Unlock()
	want := LoadReport{Load: 1, Capacity: capB}
	if len(reports) != 1 || got[0] != "chat/b" || reports[0] != want {
		t.Fatalf("OnLoadReport got %v %+v, want [chat/b] [%+v]", got, reports, want)
	}

	// b's own app: no report in its answer.
	addr, err := b.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err = http.Post("http://"+addr.String()+pathChat, "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if v := resp.Header.Get(LoadHeader); resp.StatusCode != 200 || v != "" {
		t.Errorf("b's app: status %d, %s %q; want 200 and none", resp.StatusCode, LoadHeader, v)
	}
}
