package agent

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

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
