package agent

import (
	"bufio"
	"context"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
)

// TestMeshViewOfThreeNodes: a accepts chat from b only; b and c both serve
// chat to a. While a stream a sent is in flight at b, a's mesh view shows
// every node with its state, b as serving chat to a with the in-flight
// count b's own answer to the info call gave (1: fresher than its
// advert), b's version and start, a measured RTT and a recent last-heard
// time; c serving chat but not to a, because a does not allowlist it.
func TestMeshViewOfThreeNodes(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	ub := startUpstream(t, "model-b", 20*time.Millisecond) // a 400-token stream takes 8s
	uc := startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a holds c's advert and resolves chat to b", func() bool {
		return a.resolvesTo("chat", "b") && slices.ContainsFunc(a.agent.Mesh().HeldAdverts(), func(h mesh.HeldAdvert) bool {
			return h.Origin == "c" && h.Role == "chat"
		})
	})

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	req, _ := http.NewRequestWithContext(sctx, http.MethodPost, a.url("chat")+"/v1/chat/completions",
		strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatalf("the stream's first line: %v", err)
	}
	waitFor(t, "b counts the stream in flight", func() bool { return b.agent.proxy.LocalInFlight("chat") == 1 })

	c := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer c.Close()
	var v admin.MeshView
	waitFor(t, "a has measured the RTT to b and c", func() bool {
		if v, err = c.MeshView(ctx); err != nil {
			t.Fatal(err)
		}
		return len(v.Nodes) == 3 && v.Nodes[1].RTTMillis > 0 && v.Nodes[2].RTTMillis > 0
	})
	if v.Node != "a" {
		t.Errorf("view of node %q, want a", v.Node)
	}
	self, nb, nc := v.Nodes[0], v.Nodes[1], v.Nodes[2]
	if self.Name != "a" || self.State != admin.PeerSelf || self.Version != Version || len(self.Roles) != 0 {
		t.Errorf("a in its own view = %+v", self)
	}
	if nb.Name != "b" || nb.State != admin.PeerAdmitted || nb.Version != Version || nb.StartedAt == nil || nb.InfoError != "" {
		t.Errorf("b = %+v, want admitted, version %s and its start from the info call", nb, Version)
	}
	if nb.LastHeard == nil || time.Since(*nb.LastHeard) > time.Minute {
		t.Errorf("b last heard %v, want within the last minute", nb.LastHeard)
	}
	if len(nb.Roles) != 1 || nb.Roles[0].Name != "chat" || !nb.Roles[0].ServesUs || nb.Roles[0].Model != "model-b" ||
		nb.Roles[0].InFlight == nil || *nb.Roles[0].InFlight != 1 {
		t.Errorf("b's roles = %+v, want chat serving us with 1 in flight", nb.Roles)
	}
	// The map's arrows: a's apps use chat from b; b's from itself.
	if len(self.Uses) != 1 || self.Uses[0].Role != "chat" || !slices.Equal(self.Uses[0].Nodes, []string{"b"}) {
		t.Errorf("a uses %+v, want chat from b", self.Uses)
	}
	if len(nb.Uses) != 1 || nb.Uses[0].Role != "chat" || !slices.Equal(nb.Uses[0].Nodes, []string{"b"}) {
		t.Errorf("b uses %+v, want chat from itself", nb.Uses)
	}
	if nc.Name != "c" || nc.State != admin.PeerAdmitted || nc.Version != Version {
		t.Errorf("c = %+v", nc)
	}
	if len(nc.Roles) != 1 || nc.Roles[0].ServesUs || !slices.Contains(nc.Roles[0].Why, string(placement.ReasonNotAllowlisted)) {
		t.Errorf("c's roles = %+v, want chat not serving us: not allowlisted", nc.Roles)
	}
}
