package agent

import (
	"context"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/placement"
)

// TestAllowedPeerResolvesAtOnce: an advert a consumer heard while the
// peer was not allowlisted for the role is in placement the moment the
// allowlist lets the peer in, not at the peer's next refresh. (At
// start-up, a peer's push/pull can arrive before the stored policy is
// applied: a restarted consumer reported READY with its remote roles
// unresolved.) Holds: chat resolves to b right when SetPolicy returns,
// without a wait.
func TestAllowedPeerResolvesAtOnce(t *testing.T) {
	tm := newTestMesh(t, "b", "a")
	ub := startUpstream(t, "model-b", 0)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"c"}}}, false)
	waitFor(t, "a refuses b's chat advert as not allowlisted", func() bool {
		return a.audited(placement.AuditAdvertRefused, string(placement.ReasonNotAllowlisted))
	})
	if a.resolvesTo("chat", "b") {
		t.Fatal("a resolves chat to b before it accepts b")
	}
	c := a.adminClient(t)
	if _, err := c.SetPolicy(context.Background(), admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "chat", Node: "b", On: true}); err != nil {
		t.Fatal(err)
	}
	if !a.resolvesTo("chat", "b") {
		t.Fatalf("a does not resolve chat to b right after it accepts b: %+v", a.agent.Table().Resolve("chat"))
	}
	if !chatOK(t, a) {
		t.Fatal("a's chat request, served by b, failed")
	}
}
