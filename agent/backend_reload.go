package agent

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
)

// Reload implements admin.Backend: it re-reads the config file, applies
// the new role policy (with the overrides on top) at once, hands the rest
// to AdminOptions.OnReload, and reports what changed. A config that does
// not load changes nothing.
func (b *Backend) Reload(_ context.Context, by admin.Caller) (admin.ReloadResult, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	old := b.cfg.Load()
	if old.Path() == "" {
		return admin.ReloadResult{}, admin.Errorf(admin.ErrNotConfigured, "this agent runs without a config file (dev mode)")
	}
	next, err := LoadConfig(old.Path())
	if err != nil {
		return admin.ReloadResult{}, admin.Errorf(admin.ErrInvalid, "%v (nothing changed)", err)
	}
	res := admin.ReloadResult{Config: old.Path(), Applied: []string{}, NeedsRestart: []string{}}
	res.Applied, res.NeedsRestart = diffConfig(old, next)
	// old is what runs (see runningConfig), so a change read before and
	// still waiting for a restart is reported again, and one undone in the
	// file is not.
	b.cfg.Store(runningConfig(old, next, res.NeedsRestart))
	if _, err := b.applyLocked(); err != nil {
		return res, err
	}
	if b.onReload != nil {
		err := b.onReload(old, next, &res)
		b.cfg.Store(runningConfig(old, next, res.NeedsRestart))
		if err != nil {
			return res, fmt.Errorf("reload: %w", err)
		}
	}
	res.Generation = b.a.table.Generation()
	b.a.audit.Record(Event{Kind: AuditAdminReload, Fields: map[string]string{
		"by": by.String(), "applied": fmt.Sprint(len(res.Applied)), "needs_restart": fmt.Sprint(len(res.NeedsRestart)),
	}})
	b.log.Info("config reloaded", zap.Strings("applied", res.Applied), zap.Strings("needs_restart", res.NeedsRestart))
	return res, nil
}
