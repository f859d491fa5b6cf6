package cleanup

import (
	"context"
	"errors"
	"fmt"
)

// Errors runtimes return and callers act on.
var (
	// ErrUnreachable marks a runtime whose control plane (say, the Docker
	// daemon) could not be reached. An optional runtime is skipped for it;
	// a bound one fails the operation.
	ErrUnreachable = errors.New("runtime control plane unreachable")
	// ErrUnattributable marks a site resource whose execution-target label
	// (or record) is missing or malformed, found by a cleanup scoped to
	// targets: it cannot be attributed, so nothing is removed.
	ErrUnattributable = errors.New("site resource cannot be attributed to an execution target")
	// ErrRefused marks ownership evidence that does not hold: a label or
	// record that changed since discovery, or a workload record whose
	// process is not the one it names. Nothing it names is stopped.
	ErrRefused = errors.New("ownership evidence does not hold")
)

// Runtime is one runtime's part of a site cleanup, supplied by the backend
// that knows the runtime (package provision). Its methods do blocking I/O,
// honour ctx and are called from one goroutine at a time.
type Runtime interface {
	// Name is the human-readable runtime name, such as "Docker runtime".
	Name() string
	// Discover lists the exact resources site owns within scope, without
	// changing anything, each classified: attributed to its execution
	// target and described. It fails closed: a resource it cannot
	// classify is an error (ErrUnattributable, ErrRefused), never left
	// out. An unreachable control plane is an error wrapping
	// ErrUnreachable.
	Discover(ctx context.Context, site string, scope Scope) ([]Resource, error)
	// Remove ensures r, which Discover returned for the same site and
	// scope, is absent. It re-checks r's labels or record just before
	// removing it and refuses (ErrRefused) when they no longer hold.
	// Already absent is success.
	Remove(ctx context.Context, site string, scope Scope, r Resource) error
}

// Part is one runtime of a selected site cleanup.
type Part struct {
	Runtime Runtime
	// Bound says the site's configuration binds the runtime: unreachable,
	// it fails the operation (fail closed). An unbound runtime is optional
	// and skipped, with the reason, when unreachable.
	Bound bool
}

// SiteCleanup removes the exact runtime residue of one site, across the
// runtimes a backend selected for the site's binding kinds (seed 004's
// SiteRuntimeCleanup). Every operation classifies everything first and only
// then removes anything.
type SiteCleanup struct {
	parts []Part
}

// NewSiteCleanup returns the cleanup of parts, in discovery order.
func NewSiteCleanup(parts ...Part) *SiteCleanup {
	return &SiteCleanup{parts: append([]Part(nil), parts...)}
}

// Runtimes names the selected runtimes, in discovery order, with whether
// each is bound.
func (c *SiteCleanup) Runtimes() []Part { return append([]Part(nil), c.parts...) }

// found is one runtime's discovery.
type found struct {
	rt        Runtime
	resources []Resource
}

// discover classifies every runtime's resources. An optional runtime that
// is unreachable is skipped; any other failure fails the whole pass.
func (c *SiteCleanup) discover(ctx context.Context, site string, scope Scope) ([]found, []Skipped, error) {
	var (
		all     []found
		skipped []Skipped
	)
	for _, p := range c.parts {
		rs, err := p.Runtime.Discover(ctx, site, scope)
		switch {
		case err == nil:
			all = append(all, found{p.Runtime, rs})
		case errors.Is(err, ErrUnreachable) && !p.Bound:
			skipped = append(skipped, Skipped{Runtime: p.Runtime.Name(), Reason: err})
		case errors.Is(err, ErrUnreachable):
			return nil, nil, fmt.Errorf("%s is bound by the site's configuration: %w", p.Runtime.Name(), err)
		default:
			return nil, nil, fmt.Errorf("%s: %w", p.Runtime.Name(), err)
		}
	}
	return all, skipped, nil
}

// Inventory lists the exact resources site owns within scope, grouped by
// runtime in discovery order, without changing anything. It names the
// optional runtimes it skipped.
func (c *SiteCleanup) Inventory(ctx context.Context, site string, scope Scope) (Inventory, error) {
	all, skipped, err := c.discover(ctx, site, scope)
	if err != nil {
		return Inventory{}, err
	}
	inv := Inventory{Resources: []Resource{}, Skipped: skipped}
	for _, f := range all {
		inv.Resources = append(inv.Resources, f.resources...)
	}
	if inv.Skipped == nil {
		inv.Skipped = []Skipped{}
	}
	return inv, nil
}

// Cleanup ensures the exact resources site owns within scope are absent:
// already absent is success, so running it twice is safe. Nothing is
// removed unless every runtime classified everything first. A removal that
// fails does not stop the others; the failures are joined into the error
// and the report says what was removed.
func (c *SiteCleanup) Cleanup(ctx context.Context, site string, scope Scope) (Report, error) {
	return c.Sweep(ctx, site, scope, nil)
}

// Sweep is Cleanup of the resources keep does not want: keep is asked at
// classification and again just before each removal (what it wants may
// change meanwhile), and a kept resource is reported, not removed. The
// agent's orphan sweep passes what its instances and intents still want,
// and a grace period for resources still being created.
func (c *SiteCleanup) Sweep(ctx context.Context, site string, scope Scope, keep func(Resource) bool) (Report, error) {
	all, skipped, err := c.discover(ctx, site, scope)
	if err != nil {
		return Report{}, err
	}
	rep := Report{Removed: []Resource{}, Skipped: skipped}
	if rep.Skipped == nil {
		rep.Skipped = []Skipped{}
	}
	type doomed struct {
		rt Runtime
		r  Resource
	}
	var remove []doomed
	for _, f := range all {
		for _, r := range f.resources {
			if keep != nil && keep(r) {
				rep.Kept = append(rep.Kept, r)
				continue
			}
			remove = append(remove, doomed{f.rt, r})
		}
	}
	var errs []error
	for _, d := range remove {
		if err := ctx.Err(); err != nil {
			return rep, errors.Join(append(errs, err)...)
		}
		if keep != nil && keep(d.r) {
			rep.Kept = append(rep.Kept, d.r)
			continue
		}
		if err := d.rt.Remove(ctx, site, scope, d.r); err != nil {
			errs = append(errs, fmt.Errorf("%s: remove %s: %w", d.rt.Name(), d.r.Ref, err))
			continue
		}
		rep.Removed = append(rep.Removed, d.r)
	}
	return rep, errors.Join(errs...)
}
