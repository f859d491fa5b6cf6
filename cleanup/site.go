package cleanup

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
)

// Site runs the stopped-site operations of one site on this host: site
// cleanup, reset and deletion, and this node leaving its site. They name
// no runtime: the runtimes are Backends'. Every operation but Inventory
// needs Lock, the state store's exclusive lock, which proves the agent is
// stopped.
type Site struct {
	// Name is the site; Node is this node (the execution target a leave
	// removes).
	Name string
	Node string
	// Layout is where the site keeps things on this host.
	Layout Layout
	// Bound is the binding kinds the site's configuration uses (every kind
	// when it could not be read).
	Bound KindSet
	// Backends supply the runtimes.
	Backends Backends
	// Lock is the state store's exclusive lock.
	Lock *StoreLock
}

// Outcome is what one operation found and did, for the operator.
type Outcome struct {
	Operation string `json:"operation"`
	Site      string `json:"site"`
	Node      string `json:"node"`
	Scope     Scope  `json:"scope"`
	DryRun    bool   `json:"dry_run"`
	// Found is what the read-only pass classified before anything was
	// removed: the runtimes' resources, then the located workloads.
	Found   []Resource `json:"found"`
	Skipped []Skipped  `json:"skipped"`
	// Removed resources, in order.
	Removed []Resource `json:"removed"`
	// Intents is how many durable intents were forgotten.
	Intents int `json:"intents_forgotten"`
	// Paths are the directories the operation removed (or found absent).
	Paths []PathResult `json:"paths"`
}

// PathResult is one directory an operation removes.
type PathResult struct {
	Path string `json:"path"`
	What string `json:"what"`
	// Absent: it did not exist, which counts as removed.
	Absent bool `json:"absent"`
	// RootOwned: the host could not remove some of it and the runtime
	// removed the root-owned rest.
	RootOwned bool `json:"root_owned,omitempty"`
}

// plan is what one operation does, in order.
type plan struct {
	op      string
	scope   Scope
	dryRun  bool
	located struct {
		root, node string // root "": no located workloads
	}
	forget    bool
	dir       string // removed after everything it held is stopped
	dirWhat   string
	caches    bool
	cacheNode string
}

// Inventory lists the site's runtime resources within scope without
// changing anything. It needs no lock, but callers take it when the state
// store exists, so the agent cannot be running.
func (s *Site) Inventory(ctx context.Context, scope Scope) (Inventory, error) {
	sc, err := s.Backends.SiteCleanup(s.Bound)
	if err != nil {
		return Inventory{}, err
	}
	return sc.Inventory(ctx, s.Name, scope)
}

// Cleanup ensures the site's runtime resources within scope are absent.
// Nothing else is touched.
func (s *Site) Cleanup(ctx context.Context, scope Scope, dryRun bool) (Outcome, error) {
	return s.run(ctx, plan{op: "cleanup", scope: scope, dryRun: dryRun})
}

// Reset removes every runtime resource of the site on this host and the
// workloads recorded under its site root, and forgets the durable intents:
// the next start provisions afresh. The site root, node identity, policy
// and caches stay.
func (s *Site) Reset(ctx context.Context, dryRun bool) (Outcome, error) {
	p := plan{op: "reset", scope: SiteScope(), dryRun: dryRun, forget: true}
	p.located.root = s.Layout.SiteRoot()
	return s.run(ctx, p)
}

// Delete is Reset, then the removal of the site root (root-owned leftovers
// included) and of the site's node-local workload caches.
func (s *Site) Delete(ctx context.Context, dryRun bool) (Outcome, error) {
	p := plan{op: "delete", scope: SiteScope(), dryRun: dryRun, forget: true,
		dir: s.Layout.SiteRoot(), dirWhat: "site root", caches: true}
	p.located.root = s.Layout.SiteRoot()
	return s.run(ctx, p)
}

// Leave is this node leaving its site: the cleanup of scope targets
// <this node>, the workloads recorded in its node folder, its intents, the
// node folder and its workload caches. Other nodes' resources on this host
// are left alone.
func (s *Site) Leave(ctx context.Context, dryRun bool) (Outcome, error) {
	scope, err := TargetScope(s.Node)
	if err != nil {
		return Outcome{}, err
	}
	p := plan{op: "leave", scope: scope, dryRun: dryRun, forget: true,
		dir: s.Layout.NodeDir(s.Node), dirWhat: "node folder", caches: true, cacheNode: s.Node}
	p.located.root, p.located.node = s.Layout.NodeDir(s.Node), s.Node
	return s.run(ctx, p)
}

// ErrNotLocked: a removing operation was asked for without the state
// store's lock.
var ErrNotLocked = errors.New("stopped-site operation without the state store's lock")

func (s *Site) run(ctx context.Context, p plan) (Outcome, error) {
	out := Outcome{Operation: p.op, Site: s.Name, Node: s.Node, Scope: p.scope, DryRun: p.dryRun,
		Found: []Resource{}, Skipped: []Skipped{}, Removed: []Resource{}, Paths: []PathResult{}}
	if s.Lock == nil {
		return out, ErrNotLocked
	}
	if err := s.Layout.Validate(); err != nil {
		return out, err
	}
	sc, err := s.Backends.SiteCleanup(s.Bound)
	if err != nil {
		return out, err
	}

	// Classify everything before anything stops.
	inv, err := sc.Inventory(ctx, s.Name, p.scope)
	if err != nil {
		return out, err
	}
	out.Found = append(out.Found, inv.Resources...)
	out.Skipped = inv.Skipped
	var located LocatedWorkloads
	if p.located.root != "" {
		located = s.Backends.LocatedWorkloads(p.located.root, s.Name, p.located.node)
		found, err := located.Inventory(ctx)
		if err != nil {
			return out, fmt.Errorf("%s: workloads under %s: %w", located.RuntimeName(), p.located.root, err)
		}
		out.Found = appendNew(out.Found, found)
	}
	if p.dryRun {
		return out, nil
	}

	rep, err := sc.Cleanup(ctx, s.Name, p.scope)
	out.Removed = append(out.Removed, rep.Removed...)
	out.Skipped = rep.Skipped
	if err != nil {
		return out, err
	}
	if located != nil {
		removed, err := located.Cleanup(ctx)
		out.Removed = appendNew(out.Removed, removed)
		if err != nil {
			return out, fmt.Errorf("%s: workloads under %s: %w", located.RuntimeName(), p.located.root, err)
		}
	}
	if p.forget {
		n, err := s.Backends.ForgetIntents(s.Lock)
		out.Intents = n
		if err != nil {
			return out, err
		}
	}
	if p.dir != "" {
		r, err := s.removeDir(ctx, p.dir, p.dirWhat)
		out.Paths = append(out.Paths, r)
		if err != nil {
			return out, err
		}
	}
	if p.caches {
		want := s.Layout.SiteCache()
		if p.cacheNode != "" {
			want = s.Layout.NodeCache(p.cacheNode)
		}
		removed, err := s.Backends.RemoveWorkloadCaches(ctx, s.Name, p.cacheNode)
		for _, d := range removed {
			out.Paths = append(out.Paths, PathResult{Path: d, What: "workload cache"})
		}
		if len(removed) == 0 && err == nil {
			out.Paths = append(out.Paths, PathResult{Path: want, What: "workload cache", Absent: true})
		}
		if err != nil {
			return out, err
		}
	}
	return out, nil
}

// removeDir removes dir and everything in it. What the host cannot remove
// for lack of permission (a container's root-owned files) the backends
// remove, then the host tries again.
func (s *Site) removeDir(ctx context.Context, dir, what string) (PathResult, error) {
	r := PathResult{Path: dir, What: what}
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		r.Absent = true
		return r, nil
	}
	err := os.RemoveAll(dir)
	if err == nil {
		return r, nil
	}
	if !errors.Is(err, fs.ErrPermission) {
		return r, fmt.Errorf("remove %s %s: %w", what, dir, err)
	}
	r.RootOwned = true
	if rerr := s.Backends.RemoveRootOwnedSiteData(ctx, dir); rerr != nil {
		return r, fmt.Errorf("remove %s %s: %w; removing its root-owned data: %w", what, dir, err, rerr)
	}
	if err := os.RemoveAll(dir); err != nil {
		return r, fmt.Errorf("remove %s %s after its root-owned data: %w", what, dir, err)
	}
	return r, nil
}

// appendNew appends the resources of more that are not already in rs (the
// located workloads of a directory are usually the native runtime's own).
func appendNew(rs, more []Resource) []Resource {
	for _, m := range more {
		dup := false
		for _, r := range rs {
			if r.Runtime == m.Runtime && r.Ref == m.Ref && r.Location == m.Location {
				dup = true
				break
			}
		}
		if !dup {
			rs = append(rs, m)
		}
	}
	return rs
}
