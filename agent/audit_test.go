package agent

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/mesh"
)

// TestAuditHistoryNotFlushedByRefusals: a flood of refusals keeps only the
// newest refusals, never pushing out the joins and changes recorded
// before it.
func TestAuditHistoryNotFlushedByRefusals(t *testing.T) {
	a := NewAuditor(zap.NewNop())
	for i := range 5 {
		a.Record(Event{Kind: mesh.AuditPeerJoined, Node: fmt.Sprintf("n%d", i)})
	}
	for i := range 1000 {
		a.Record(Event{Kind: mesh.AuditQUICRefused, Node: fmt.Sprintf("addr:127.0.0.%d", i%250)})
	}
	var joins, refused int
	for _, e := range a.Recent() {
		switch e.Kind {
		case mesh.AuditPeerJoined:
			joins++
		case mesh.AuditQUICRefused:
			refused++
		}
	}
	if joins != 5 || refused != auditHistory {
		t.Errorf("history holds %d joins and %d refusals, want 5 and %d", joins, refused, auditHistory)
	}
}

// TestAdminRefusalsRateLimitedPerCaller: one caller's repeated refusal is
// let through once per interval; another caller's still is.
func TestAdminRefusalsRateLimitedPerCaller(t *testing.T) {
	var l auditLimiter
	now := time.Unix(1000, 0)
	if !l.allow("uid 1000\x00read only", now) || l.allow("uid 1000\x00read only", now.Add(auditEvery/2)) {
		t.Error("the same caller and reason passed twice within the interval")
	}
	if !l.allow("uid 1001\x00read only", now) {
		t.Error("another caller was held back")
	}
	if !l.allow("uid 1000\x00read only", now.Add(auditEvery)) {
		t.Error("the caller was held back after the interval")
	}
}

// TestAuditHistorySurvivesRestart: both histories are kept in the state
// store, within their bounds, and come back after a restart before what
// the new run records.
func TestAuditHistorySurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	aa := startAdminAgent(t, cfg, AdminOptions{})
	ctx := context.Background()
	if _, err := aa.client.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindServeTo, Role: "chat", Node: "e", On: true}); err != nil {
		t.Fatal(err)
	}
	aa.a.audit.Record(Event{Kind: mesh.AuditPeerJoined, Node: "before-restart"})
	for i := range 3 * auditHistory {
		aa.a.audit.Record(Event{Kind: mesh.AuditQUICRefused, Node: fmt.Sprintf("addr:127.0.0.%d", i%250), Fields: map[string]string{"n": fmt.Sprint(i)}})
	}
	before := aa.a.audit.Recent()
	aa.stop()

	aa = startAdminAgent(t, cfg, AdminOptions{})
	after := aa.a.audit.Recent()
	var joined, policy, refused int
	lastRefused := ""
	for _, e := range after {
		switch {
		case e.Kind == mesh.AuditPeerJoined && e.Node == "before-restart":
			joined++
		case e.Kind == mesh.AuditQUICRefused:
			refused++
			lastRefused = e.Fields["n"]
		case e.Kind == AuditAdminPolicy && e.Node == "e":
			policy++
		}
	}
	if joined != 1 || policy == 0 {
		t.Errorf("after a restart: %d of the join and %d policy changes recorded before it, want 1 and at least 1\n%+v", joined, policy, after)
	}
	if refused != auditHistory || lastRefused != fmt.Sprint(3*auditHistory-1) {
		t.Errorf("after a restart: %d refusals, the last n=%s; want the newest %d, the last n=%d", refused, lastRefused, auditHistory, 3*auditHistory-1)
	}
	if len(after) < len(before) {
		t.Errorf("history shrank across the restart: %d events, %d before", len(after), len(before))
	}
	if !after[0].Time.Equal(before[0].Time) {
		t.Errorf("the oldest event's time changed: %v, was %v", after[0].Time, before[0].Time)
	}
}
