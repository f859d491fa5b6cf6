package cleanup

import "context"

// Backends are the runtime-specific cleanups of a stopped site (seed 004's
// SiteRuntimeCleanups), supplied by the package that knows the runtimes
// (provision), so that the code orchestrating a removal (Site) names no
// runtime. Methods that take ctx do blocking I/O.
type Backends interface {
	// SiteCleanup selects the cleanup of the runtimes for the binding
	// kinds the site's configuration uses, without contacting any of
	// them. A runtime of a kind in bound fails closed when unreachable;
	// the backend's other runtimes are included as optional, since a
	// configuration that no longer binds a runtime may still have left
	// resources in it. A kind whose resources need no site-wide cleanup
	// (simulated) selects nothing.
	SiteCleanup(bound KindSet) (*SiteCleanup, error)

	// LocatedWorkloads selects the cleanup of the workloads held by their
	// location under root: a site root or node folder about to be
	// deleted. Each workload's record must name site and, when node is
	// not "", node.
	LocatedWorkloads(root, site, node string) LocatedWorkloads

	// RemoveRootOwnedSiteData removes site data a runtime left owned by
	// root beneath dir (the site root or a folder in it), after the host
	// could not remove it.
	RemoveRootOwnedSiteData(ctx context.Context, dir string) error

	// RemoveWorkloadCaches removes the node-local workload caches of site
	// (only node's, when node is not ""), which live outside the site
	// root. Other sites' caches are left alone; an absent cache is
	// already removed. It reports the directories it removed.
	RemoveWorkloadCaches(ctx context.Context, site, node string) ([]string, error)

	// ForgetIntents drops the durable intents the runtimes keep in the
	// locked state store, once the resources they name are gone.
	ForgetIntents(lock *StoreLock) (int, error)
}

// LocatedWorkloadCleanup is the cleanup of the workloads found under one
// directory about to be deleted, by their records. The ownership evidence
// of each (its record names the expected site and node; its process is
// alive with the recorded start time and executable) is checked before
// anything stops, so evidence that does not hold refuses the removal
// (ErrRefused) and names why.
type LocatedWorkloads interface {
	// RuntimeName is the human-readable runtime name, such as
	// "native runtime".
	RuntimeName() string
	// Inventory describes the owned workloads without changing anything.
	Inventory(ctx context.Context) ([]Resource, error)
	// Cleanup stops and removes every owned workload and reports them.
	Cleanup(ctx context.Context) ([]Resource, error)
}
