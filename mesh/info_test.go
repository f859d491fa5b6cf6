package mesh

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The info call answers a verified, admitted peer with what the Info
// callback gives, before the peer handler (which never sees it); a peer no
// longer admitted is refused without Info being asked; an answer that
// names another node, or a node that gives no info, is an error naming
// the node.
func TestInfoCall(t *testing.T) {
	dir := newStaticDir()
	var handled, asked atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handled.Add(1) })
	name := atomic.Value{}
	name.Store("b")
	startNode(t, dir, "b", h, func(c *TransportConfig) {
		c.Info = func() NodeInfo {
			asked.Add(1)
			return NodeInfo{Name: name.Load().(string), Version: "v9", Roles: []RoleInfo{{Name: "chat", Model: "m", InFlight: 3}}}
		}
	})
	startNode(t, dir, "c", h, nil) // gives no info
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	ni, err := a.tr.Info(ctx, "b")
	if err != nil {
		t.Fatalf("Info(b) = %v", err)
	}
	if ni.Name != "b" || ni.Version != "v9" || len(ni.Roles) != 1 || ni.Roles[0] != (RoleInfo{Name: "chat", Model: "m", InFlight: 3}) {
		t.Fatalf("Info(b) = %+v", ni)
	}
	if handled.Load() != 0 {
		t.Fatal("the info call reached the peer handler")
	}

	name.Store("c")
	if _, err := a.tr.Info(ctx, "b"); err == nil || !strings.Contains(err.Error(), `names "c"`) {
		t.Fatalf("Info(b) answering as c = %v, want an error naming it", err)
	}
	if _, err := a.tr.Info(ctx, "c"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("Info(c), which gives none = %v, want 404", err)
	}

	before := asked.Load()
	dir.revoke("a")
	if _, err := a.tr.Info(ctx, "b"); err == nil {
		t.Fatal("Info(b) from a no longer admitted: answered")
	}
	if asked.Load() != before {
		t.Fatal("b asked its Info for a peer it no longer admits")
	}
}

// Members reports the round-trip time memberlist's probes measured to
// each peer and when the last was answered; nothing for this node.
func TestMembersCarryRTT(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.node("a"), c.node("b")
	b.join(t, a)
	eventually(t, 3*time.Second, "a has measured the RTT to b", func() bool {
		for _, p := range a.m.Members() {
			if p.Name == "b" {
				return p.RTT > 0 && !p.Heard.IsZero()
			}
		}
		return false
	})
	for _, p := range a.m.Members() {
		if p.Self && (p.RTT != 0 || !p.Heard.IsZero()) {
			t.Fatalf("a's own entry carries an RTT: %+v", p)
		}
		if p.Name == "b" && (p.RTT > 5*time.Second || time.Since(p.Heard) > time.Minute) {
			t.Fatalf("b's RTT or heard time is not of a probe just answered: %+v", p)
		}
	}
}
