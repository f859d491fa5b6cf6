package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
)

// reloadPart applies a reload's changes of one class (configdiff.go). The
// backend applies role policy itself; the agent hands it the others
// (AdminOptions.parts). Reload calls plan, then apply, under the backend's
// lock: never two calls at once.
type reloadPart interface {
	// plan returns, by change path, why a change of changes (the reload's
	// changes of the part's class) cannot be applied while the agent runs
	// and waits for a restart. It changes nothing. An error refuses the
	// whole reload.
	plan(old, next *Config, changes []configChange) (waits map[string]string, err error)
	// apply makes what the part runs follow cur, the current config from
	// now on (old was), for changes, the ones plan accepted. A role whose
	// serving the part fails to change stays as it was, and Reload puts
	// back its changes.
	apply(old, cur *Config, changes []configChange) []reloadFailure
}

// reloadFailure is a change a part accepted and then failed to apply.
type reloadFailure struct {
	role string // whose serving stays as it was ("" when not a role's)
	what string // what failed, as the answer names it ("": err names the field)
	err  error
}

func (f reloadFailure) Error() string {
	if f.what == "" {
		return f.err.Error() // it names the field itself
	}
	return f.what + ": " + f.err.Error()
}

// policyPart applies role policy: the config with the stored overrides on
// top, whatever changed (a role added or removed brings or takes its own).
type policyPart struct{ b *Backend }

func (policyPart) plan(*Config, *Config, []configChange) (map[string]string, error) { return nil, nil }

func (p policyPart) apply(*Config, *Config, []configChange) []reloadFailure {
	if _, err := p.b.applyLocked(); err != nil {
		return []reloadFailure{{what: "role policy", err: err}}
	}
	return nil
}

// Reload implements admin.Backend: it re-reads the config file, compares
// it with the current config field by field, has the part of each
// change's class apply it (or say why it waits for a restart), makes the
// config of the changes in force the current one, and reports them. A
// config that does not load changes nothing.
//
// The current config is what runs, not the last file read: a change that
// waits is reported again by the next reload, and not at all once the file
// says what runs again.
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
	changes := diffConfig(old, next)
	waits, err := b.planReload(old, next, changes)
	if err != nil {
		return admin.ReloadResult{}, admin.Errorf(admin.ErrInvalid, "%v (nothing changed)", err)
	}
	var now, later []configChange
	for i, c := range changes {
		if _, ok := waits[i]; ok {
			later = append(later, c)
		} else {
			now = append(now, c)
		}
	}
	cur := withOld(next, old, later)
	b.cfg.Store(cur)

	var failed []reloadFailure
	for _, class := range reloadClasses {
		part := b.parts[class]
		if part == nil {
			continue
		}
		fs := part.apply(old, cur, ofClass(now, class))
		if len(fs) == 0 {
			continue
		}
		failed = append(failed, fs...)
		var undo []configChange
		now = slices.DeleteFunc(now, func(c configChange) bool {
			back := c.serving() && slices.ContainsFunc(fs, func(f reloadFailure) bool { return f.role == c.role() })
			if back {
				undo = append(undo, c)
			}
			return back
		})
		if len(undo) > 0 {
			cur = withOld(cur, old, undo)
			b.cfg.Store(cur)
		}
	}

	res := admin.ReloadResult{Config: old.Path(), Applied: []string{}, NeedsRestart: []string{}, Generation: b.a.table.Generation()}
	for _, c := range now {
		res.Applied = append(res.Applied, c.String())
	}
	for i, c := range changes {
		if why, ok := waits[i]; ok {
			s := c.String()
			if why != "" {
				s += " (" + why + ")"
			}
			res.NeedsRestart = append(res.NeedsRestart, s)
		}
	}
	b.a.audit.Record(Event{Kind: AuditAdminReload, Fields: map[string]string{
		"by": by.String(), "applied": fmt.Sprint(len(res.Applied)), "needs_restart": fmt.Sprint(len(res.NeedsRestart)),
		"failed": fmt.Sprint(len(failed)),
	}})
	if len(failed) > 0 {
		msgs := make([]string, 0, len(failed))
		for _, f := range failed {
			msgs = append(msgs, f.Error())
		}
		b.log.Error("config reload failed in part", zap.Strings("failed", msgs), zap.Strings("applied", res.Applied), zap.Strings("needs_restart", res.NeedsRestart))
		return res, admin.Errorf(admin.ErrConflict, "reload: %s (what failed stays as it was; the rest of the reload is in force: %d applied, %d need a restart)",
			strings.Join(msgs, "; "), len(res.Applied), len(res.NeedsRestart))
	}
	b.log.Info("config reloaded", zap.Strings("applied", res.Applied), zap.Strings("needs_restart", res.NeedsRestart))
	return res, nil
}

// planReload asks each class's part which of its changes wait for a
// restart, and why (by index into changes; "" is the class's own reason:
// it is read at start). A class without a part waits whole. How a role is
// served here changes as a whole: when one of its serving changes waits,
// all of them do, so what runs is the role as it was or as the file says,
// never a mix the file never said.
func (b *Backend) planReload(old, next *Config, changes []configChange) (map[int]string, error) {
	waits := map[int]string{}
	for _, class := range reloadClasses {
		var idx []int
		for i, c := range changes {
			if c.class == class {
				idx = append(idx, i)
			}
		}
		if class == classLive || len(idx) == 0 {
			continue
		}
		part := b.parts[class]
		if class == classRestart || part == nil {
			for _, i := range idx {
				waits[i] = ""
			}
			continue
		}
		sub := make([]configChange, 0, len(idx))
		for _, i := range idx {
			sub = append(sub, changes[i])
		}
		why, err := part.plan(old, next, sub)
		if err != nil {
			return nil, err
		}
		for _, i := range idx {
			if w, ok := why[changes[i].path]; ok {
				waits[i] = w
			}
		}
	}
	var held []int
	for i := range waits {
		if changes[i].serving() {
			held = append(held, i)
		}
	}
	slices.Sort(held)
	for _, i := range held {
		for j, c := range changes {
			if _, ok := waits[j]; !ok && c.serving() && c.role() == changes[i].role() {
				waits[j] = "with " + changes[i].path
			}
		}
	}
	return waits, nil
}

// ofClass is the changes of class.
func ofClass(changes []configChange, class reloadClass) []configChange {
	var out []configChange
	for _, c := range changes {
		if c.class == class {
			out = append(out, c)
		}
	}
	return out
}
