package agent

import (
	"bufio"
	"net/http"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/placement"
)

// remoteEntry returns a's entry for (role, node), if it holds one.
func remoteEntry(n *meshNode, role, node string) (placement.RemoteEntry, bool) {
	for _, e := range n.agent.Table().Snapshot().Remotes {
		if e.Role == role && e.Node == node {
			return e, true
		}
	}
	return placement.RemoteEntry{}, false
}

// TestAdvertisedLoadIsInFlight: while a stream from b's instance is open,
// b advertises chat with load 1, and 0 again once it ended.
func TestAdvertisedLoadIsInFlight(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 20_000_000) // 20ms a token: a long stream
	a, _ := tm.chatFromB(ub)
	resp, err := http.Post(a.url("chat")+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "b advertises load 1", func() bool { e, ok := remoteEntry(a, "chat", "b"); return ok && e.Advert.Load == 1 })
	resp.Body.Close()
	waitFor(t, "b advertises load 0", func() bool { e, ok := remoteEntry(a, "chat", "b"); return ok && e.Advert.Load == 0 })
}

// TestStaleAdvertsAreSwept: an advert nobody refreshes is forgotten once
// its TTL ran out, not only hidden from resolution.
func TestStaleAdvertsAreSwept(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	a := tm.start("a", map[string]roleSpec{"x": {}}, false)
	tm.start("b", map[string]roleSpec{"y": {}}, false)
	waitFor(t, "a admits b", func() bool { return a.agent.Mesh().IsAdmitted("b") })
	tab := a.agent.Table()
	tab.AllowRemoteNode("ghost", "b", true)
	if err := tab.IngestAdvertisement("b", placement.Advert{Name: placement.ServicePrefix + "ghost", Node: "b", API: "openai"}); err != nil {
		t.Fatal(err)
	}
	gen := tab.Generation()
	if _, ok := remoteEntry(a, "ghost", "b"); !ok {
		t.Fatal("a does not hold the ghost advert")
	}
	waitFor(t, "the ghost advert is swept", func() bool { _, ok := remoteEntry(a, "ghost", "b"); return !ok })
	if tab.Generation() <= gen {
		t.Errorf("generation %d after the sweep, want above %d", tab.Generation(), gen)
	}
}
