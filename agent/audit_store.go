package agent

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/store"
)

// The audit history in the state store (store.AgentAudit): both histories
// (refusals, the rest), each bounded by auditHistory, saved whole under
// keyAudit at most every auditSaveInterval while events come and once at
// stop, and put back before what the next run records.
const keyAudit = "history"

// auditSaveInterval bounds how often a flood of events is written.
const auditSaveInterval = 2 * time.Second

type savedAudit struct {
	Recent  []Event `json:"recent"`
	Refused []Event `json:"refused"`
}

// restore puts saved history before what was recorded since the start,
// within the bounds.
func (a *Auditor) restore(s savedAudit) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.recent = lastN(append(s.Recent, a.recent...), auditHistory)
	a.refused = lastN(append(s.Refused, a.refused...), auditHistory)
}

// saved returns both histories and their version (bumped by every event).
func (a *Auditor) saved() (savedAudit, uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return savedAudit{Recent: append([]Event(nil), a.recent...), Refused: append([]Event(nil), a.refused...)}, a.version
}

// persistAudit loads the saved audit history from st and keeps saving it
// while events come. The returned stop saves a last time; call it before
// st closes.
func (a *Agent) persistAudit(st *store.Store) (stop func()) {
	bucket, err := store.OpenBucket[savedAudit](st, store.AgentAudit)
	if err != nil {
		a.log.Warn("cannot keep the audit history in the state store", zap.Error(err))
		return func() {}
	}
	if s, _, err := bucket.Get(keyAudit); err != nil {
		a.log.Warn("cannot load the audit history from the state store; starting without it", zap.Error(err))
	} else {
		a.audit.restore(s)
	}
	var last uint64
	save := func() {
		s, v := a.audit.saved()
		if v == last {
			return
		}
		if err := bucket.Put(keyAudit, s); err != nil {
			a.log.Warn("cannot save the audit history", zap.Error(fmt.Errorf("state store: %w", err)))
			return
		}
		last = v
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(auditSaveInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				save()
			}
		}
	}()
	return func() {
		cancel()
		<-done
		save()
	}
}
