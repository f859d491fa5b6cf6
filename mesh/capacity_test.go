package mesh

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/infermesh/infermesh/placement"
)

// capOfRemote is the capacity n holds for role from node ("" when none).
func capOfRemote(n *testNode, role, node string) (placement.Capacity, bool) {
	for _, c := range n.tab.Resolve(role) {
		if c.Kind == placement.KindRemote && c.Node == node {
			return c.Capacity, true
		}
	}
	return placement.Capacity{}, false
}

// A serving node's capacity (its instance's slots, running, waiting and KV
// cache use) travels in its signed advert; a change is sent within the
// load adverts' budget (about 3 s between two nodes: loadAdvertInterval).
func TestCapacityTravelsInAdverts(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.node("a"), c.node("b")
	b.serve(t, "chat", "m")
	a.tab.AllowRemoteNode("chat", "b", true)
	first := placement.Capacity{Slots: 4, Running: 1, Waiting: 0, KVUsage: 0.25}
	b.tab.SetLocalCapacity("chat", first)
	b.join(t, a)
	eventually(t, 3*time.Second, "a holds b's capacity", func() bool {
		got, ok := capOfRemote(a, "chat", "b")
		return ok && got == first
	})
	next := placement.Capacity{Slots: 4, Running: 4, Waiting: 3, KVUsage: 0.9, CacheTokens: 16384, HasCacheHit: true}
	b.tab.SetLocalCapacity("chat", next)
	eventually(t, 10*time.Second, "a holds b's new capacity", func() bool {
		got, _ := capOfRemote(a, "chat", "b")
		return got == next
	})
	for _, d := range a.tab.Explain("chat") {
		if d.Node == "b" && d.Capacity != next {
			t.Errorf("Explain shows b's capacity %+v, want %+v", d.Capacity, next)
		}
	}
}

// A change of load alone is advertised as often as the budget pays for:
// each of N nodes sends an advert RetransmitMult x ceil(log10(N+1))
// times; never more than once a second, never less than a refresh.
func TestLoadAdvertInterval(t *testing.T) {
	refresh := 20 * time.Second
	for _, tt := range []struct {
		size, members, budget int
		want                  time.Duration
	}{
		{300, 2, 400, 3 * time.Second},     // 300 B x 4 x 1 / 400 B/s
		{300, 10, 400, 6 * time.Second},    // x 4 x 2 (log10(11) rounds up to 2)
		{300, 1000, 400, 12 * time.Second}, // x 4 x 4
		{300, 100000, 100, refresh},        // past a refresh: the refresh
		{50, 2, 4000, time.Second},         // under a second: a second
		{300, 10, 0, time.Second},          // no budget: the old bound
		{0, 10, 400, time.Second},          // nothing sent yet
	} {
		if got := loadAdvertInterval(tt.size, tt.members, 4, tt.budget, refresh); got != tt.want {
			t.Errorf("loadAdvertInterval(%d B, %d members, budget %d) = %v, want %v", tt.size, tt.members, tt.budget, got, tt.want)
		}
	}
}

// An advert of a node that sends no capacity (an earlier version) is read
// with none; a KV share outside 0..1 from a broken or hostile origin is
// clamped.
func TestAdvertCapacityDecoding(t *testing.T) {
	for _, tt := range []struct {
		body string
		want placement.Capacity
	}{
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"]}`, placement.Capacity{}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"r":2,"w":1,"kv":0.5}}`, placement.Capacity{Slots: 8, Running: 2, Waiting: 1, KVUsage: 0.5}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"r":2,"kv":0.5,"c":16384}}`, placement.Capacity{Slots: 8, Running: 2, KVUsage: 0.5, CacheTokens: 16384}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"kv":-3}}`, placement.Capacity{Slots: 8}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"kv":7}}`, placement.Capacity{Slots: 8, KVUsage: 1}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"h":0.734}}`, placement.Capacity{Slots: 8, CacheHit: 0.73, HasCacheHit: true}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"h":0}}`, placement.Capacity{Slots: 8, HasCacheHit: true}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"h":-2}}`, placement.Capacity{Slots: 8, HasCacheHit: true}},
		{`{"role":"chat","origin":"b","seq":1,"set":["chat"],"cap":{"s":8,"h":9}}`, placement.Capacity{Slots: 8, CacheHit: 1, HasCacheHit: true}},
	} {
		var b advertBody
		if err := json.Unmarshal([]byte(tt.body), &b); err != nil {
			t.Fatal(err)
		}
		if got := b.advert().Capacity; got != tt.want {
			t.Errorf("%s: capacity %+v, want %+v", tt.body, got, tt.want)
		}
	}
	if capOf(placement.Capacity{}) != nil {
		t.Error("an unknown capacity is sent")
	}
}
