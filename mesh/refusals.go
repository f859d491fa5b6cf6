package mesh

import (
	"errors"
	"maps"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/placement"
)

// Audit kinds of the mesh's own refusals (placement audits its own, with
// placement.AuditAdvertRefused).
const (
	// AuditNodeRefused: a node's alive message or join was refused.
	AuditNodeRefused = "mesh.node.refused"
	// AuditAdvertRefused: a gossiped advert was not verified or was stale.
	AuditAdvertRefused = "mesh.advert.refused"

	auditNodeRefused   = AuditNodeRefused
	auditAdvertRefused = AuditAdvertRefused
)

// Refusal reasons: the keys of Refusals(). Stable strings, fit for metrics.
const (
	reasonMalformed     = "malformed"
	reasonWrongCluster  = "wrong_cluster"
	reasonBadMeta       = "bad_meta"
	reasonUnadmitted    = "unadmitted_node"
	reasonNameConflict  = "name_conflict"
	reasonKeyConflict   = "key_conflict"
	reasonUnknownOrigin = "unknown_origin"
	reasonBadSignature  = "bad_signature"
	reasonNotFullScope  = "not_full_scope"
	reasonStale         = "stale_sequence"
	reasonNotAllowlist  = "not_allowlisted"
	reasonPlacement     = "placement_refused"
)

// auditEvery rate-limits the audit of one repeated refusal (same kind,
// node, role and reason): gossip repeats messages, and a refused node keeps
// sending. Every refusal is counted regardless.
const auditEvery = 10 * time.Second

type refusals struct {
	mu        sync.Mutex
	counts    map[string]uint64
	lastAudit map[string]time.Time
}

func (r *refusals) init() {
	r.counts = map[string]uint64{}
	r.lastAudit = map[string]time.Time{}
}

func (r *refusals) snapshot() map[string]uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.counts)
}

// count counts a refusal and reports whether it should be audited now.
func (r *refusals) count(kind, node, role, why string) bool {
	now := time.Now()
	k := kind + "\x00" + node + "\x00" + role + "\x00" + why
	r.mu.Lock()
	defer r.mu.Unlock()
	r.counts[why]++
	if last, ok := r.lastAudit[k]; ok && now.Sub(last) < auditEvery {
		return false
	}
	if len(r.lastAudit) > 4096 {
		for k, t := range r.lastAudit {
			if now.Sub(t) >= auditEvery {
				delete(r.lastAudit, k)
			}
		}
	}
	r.lastAudit[k] = now
	return true
}

// refuse counts and audits a refusal.
func (m *Mesh) refuse(kind, node, role, why, detail string) {
	if !m.refusals.count(kind, node, role, why) {
		return
	}
	m.log.Info("refused", zap.String("kind", kind), zap.String("peer", node), zap.String("role", role),
		zap.String("why", why), zap.String("detail", detail))
	if m.cfg.Audit != nil {
		m.cfg.Audit.Audit(placement.AuditEvent{
			Kind: kind, Role: role, Node: node,
			Fields: map[string]string{"why": why, "detail": detail, "consumer": m.name},
		})
	}
}

// countPlacement counts a refusal by the placement table, which audited it
// itself.
func (m *Mesh) countPlacement(err error) {
	why := reasonPlacement
	var re *placement.RefusedError
	if errors.As(err, &re) {
		switch re.Reason {
		case placement.ReasonNotAllowlisted:
			why = reasonNotAllowlist
		case placement.ReasonNotAdmitted:
			why = reasonUnadmitted
		case placement.ReasonMayNotServe:
			why = reasonNotFullScope
		}
	}
	m.refusals.mu.Lock()
	m.refusals.counts[why]++
	m.refusals.mu.Unlock()
}
