package agent

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/mesh"
)

// chatOK sends one chat request to n's chat port and reports whether it
// succeeded.
func chatOK(t *testing.T, n *meshNode) bool {
	t.Helper()
	resp, err := http.Post(n.url("chat")+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func members(m *mesh.Mesh) []string {
	var out []string
	for _, p := range m.Members() {
		out = append(out, p.Name)
	}
	return out
}

// TestMeshRestartEachNodeServes: a 3-node mesh where a (the seed) joins
// nobody and b, c join a. Each node in turn, the seed first, stops and
// starts again: the mesh re-forms and a serves chat from b and c again,
// with nobody running join.
func TestMeshRestartEachNodeServes(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	ub, uc := startUpstream(t, "model-b", 0), startUpstream(t, "model-c", 0)
	roles := map[string]map[string]roleSpec{
		"a": {"chat": {acceptFrom: []string{"b", "c"}}},
		"b": {"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}},
		"c": {"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}},
	}
	nodes := map[string]*meshNode{}
	for _, name := range []string{"a", "b", "c"} {
		nodes[name] = tm.start(name, roles[name], false)
	}
	whole := func(what string) {
		t.Helper()
		waitFor(t, what, func() bool {
			for _, n := range nodes {
				if !slices.Equal(members(n.agent.Mesh()), []string{"a", "b", "c"}) {
					return false
				}
			}
			return nodes["a"].resolvesTo("chat", "b", "c") && chatOK(t, nodes["a"])
		})
	}
	whole("the mesh forms and a serves chat")
	for _, name := range []string{"a", "b", "c"} {
		tm.stop(name)
		nodes[name] = tm.start(name, roles[name], false)
		whole("the mesh re-forms and a serves chat after restarting " + name)
	}
}

// TestMeshRejoinsLastKnownPeers: c joined through b, so neither a's nor
// c's configuration names the other. All three stop; with b gone for good,
// a and c start again and find each other from the peers each saw last,
// which a restarted agent reads from its state store.
func TestMeshRejoinsLastKnownPeers(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	tm.joins = map[string]string{"c": "b"}
	uc := startUpstream(t, "model-c", 0)
	roles := map[string]map[string]roleSpec{
		"a": {"chat": {acceptFrom: []string{"c"}}},
		"b": {"other": {}},
		"c": {"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}},
	}
	nodes := map[string]*meshNode{}
	for _, name := range []string{"a", "b", "c"} {
		nodes[name] = tm.start(name, roles[name], false)
	}
	waitFor(t, "the mesh forms", func() bool {
		return slices.Equal(members(nodes["a"].agent.Mesh()), []string{"a", "b", "c"}) &&
			slices.Equal(members(nodes["c"].agent.Mesh()), []string{"a", "b", "c"})
	})
	// a and c saved each other (the save follows the join within a
	// rejoin interval).
	for _, name := range []string{"a", "c"} {
		waitFor(t, name+" saved its peers", func() bool {
			pb, err := newPeerBook(nodes[name].agent.admin.Store())
			if err != nil {
				t.Fatal(err)
			}
			p, err := pb.LoadPeers()
			return err == nil && len(p) == 2
		})
	}
	// Everyone stops; a and c start again, knowing each other only from
	// their state stores (a has no mesh.join, c's names b).
	for _, name := range []string{"b", "a", "c"} {
		tm.stop(name)
	}
	for _, name := range []string{"a", "c"} {
		nodes[name] = tm.start(name, roles[name], false)
	}
	waitFor(t, "a and c find each other", func() bool {
		return slices.Equal(members(nodes["a"].agent.Mesh()), []string{"a", "c"}) &&
			slices.Equal(members(nodes["c"].agent.Mesh()), []string{"a", "c"}) &&
			nodes["a"].resolvesTo("chat", "c") && chatOK(t, nodes["a"])
	})
}

// TestJoinCommand: two nodes configured with no mesh.join at all meet when
// an operator runs `infermesh join` on one of them (over the admin
// socket), and a bad address is refused with a clear error.
func TestJoinCommand(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.joins = map[string]string{"b": ""}
	a := tm.start("a", map[string]roleSpec{"x": {}}, false)
	b := tm.start("b", map[string]roleSpec{"x": {}}, false)
	c := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Join(ctx, []string{"no-port"}); !errors.Is(err, admin.ErrInvalid) {
		t.Errorf("join no-port: %v, want ErrInvalid", err)
	}
	res, err := c.Join(ctx, []string{b.bind})
	if err != nil {
		t.Fatalf("join %s: %v", b.bind, err)
	}
	if res.Contacted != 1 {
		t.Errorf("contacted %d, want 1", res.Contacted)
	}
	waitFor(t, "a and b see each other", func() bool {
		return slices.Equal(members(a.agent.Mesh()), []string{"a", "b"}) && slices.Equal(members(b.agent.Mesh()), []string{"a", "b"})
	})
	if !a.audited(AuditAdminJoin, "") {
		t.Errorf("the join was not audited")
	}
}

// TestUnknownPolicyNodesWarned: with static trust only, a serve_to or
// accept_from name outside trust.nodes is reported (a typo); with an
// authority it is not.
func TestUnknownPolicyNodesWarned(t *testing.T) {
	c := &Config{Node: NodeConfig{Name: "a"}, Roles: map[string]RoleConfig{
		"chat": {AcceptFrom: []string{"b", "bb"}, ServeTo: []string{"c"}},
	}}
	c.Trust.Nodes = []TrustedNode{{Name: "b"}}
	got := c.UnknownPolicyNodes()
	if len(got) != 2 || !strings.Contains(got[0], `roles.chat.accept_from names "bb"`) || !strings.Contains(got[1], `roles.chat.serve_to names "c"`) {
		t.Errorf("UnknownPolicyNodes() = %q, want bb (accept_from) and c (serve_to)", got)
	}
	c.Trust.Authority = "x"
	if got := c.UnknownPolicyNodes(); len(got) != 0 {
		t.Errorf("with an authority: %q, want none", got)
	}
}
