package agent

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/proxy"
)

// TestRefusedHeaderAgrees: the transport's own refusals and the peer
// handler's carry the same header, which the consumer's proxy reads.
func TestRefusedHeaderAgrees(t *testing.T) {
	if mesh.RefusedHeader != proxy.RefusedHeader {
		t.Fatalf("mesh.RefusedHeader = %q, proxy.RefusedHeader = %q", mesh.RefusedHeader, proxy.RefusedHeader)
	}
}

// TestServeToRemovedFailsOver: b and c both serve chat to a. While a
// sends a steady stream of requests, b's operator removes a from chat's
// serve list. b's refusals are failures before the first byte: a fails
// over to c, and not one request fails; a's route shows b's refusal.
func TestServeToRemovedFailsOver(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	ub, uc := startUpstream(t, "model-b", 0), startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })

	var sent, failed int
	var failures []string
	send := func() {
		sent++
		resp, err := http.Post(a.url("chat")+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			failed++
			failures = append(failures, err.Error())
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			failed++
			failures = append(failures, resp.Status+" "+string(body))
		}
	}
	waitFor(t, "b serves some of a's requests", func() bool { send(); return ub.requests.Load() > 0 })

	bc := admin.NewClient(b.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer bc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := bc.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindServeTo, Role: "chat", Node: "a", On: false}); err != nil {
		t.Fatal(err)
	}
	bServed := ub.requests.Load()
	for range 100 {
		send()
	}
	if failed != 0 {
		t.Errorf("%d of %d requests failed, want 0: %v", failed, sent, failures)
	}
	if got := ub.requests.Load(); got != bServed {
		t.Errorf("b's instance served %d requests after a left its serve list, want 0", got-bServed)
	}
	if !b.audited("infer.peer.refused", "") {
		t.Errorf("b did not audit its refusals")
	}
	rt, err := a.agent.admin.Backend().Route(ctx, "chat")
	if err != nil {
		t.Fatal(err)
	}
	if rt.Serving != "c" {
		t.Errorf("route chat on a: serving %q, want c", rt.Serving)
	}
	noted := false
	for _, d := range rt.Decisions {
		for _, n := range d.Notes {
			noted = noted || (d.Node == "b" && strings.Contains(n, proxy.RefusedNotServed))
		}
	}
	if !noted {
		t.Errorf("route chat on a does not show b's refusal: %+v", rt.Decisions)
	}
}
