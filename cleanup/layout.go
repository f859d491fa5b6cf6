package cleanup

import (
	"fmt"
	"path/filepath"

	"github.com/infermesh/infermesh/identity"
)

// Layout is where one site keeps things on this host.
//
//	<state dir>/                          the node's key, state store, keyring
//	<state dir>/sites/<site>/             the site root
//	<site root>/nodes/<node>/             a node folder
//	<node folder>/workloads/<ref>.json    native workload records
//	<node folder>/logs/<ref>.std{out,err}.log
//	<cache root>/<site>/<node>/<role>/    node-local workload caches (outside the site root)
//
// The node's own identity and state store sit beside the site root, not in
// it: deleting a site removes what the site ran and kept, not the node.
type Layout struct {
	// StateDir is node.state_dir. Default config.DefaultStateDir.
	StateDir string
	// CacheRoot is node.cache_dir. Default config.DefaultCacheDir.
	CacheRoot string
	// Site is the site name.
	Site string
}

// Validate checks the directories are absolute and the site is a valid
// name (so it is one path element).
func (l Layout) Validate() error {
	if !filepath.IsAbs(l.StateDir) {
		return fmt.Errorf("layout: state dir %q is not absolute", l.StateDir)
	}
	if !filepath.IsAbs(l.CacheRoot) {
		return fmt.Errorf("layout: cache dir %q is not absolute", l.CacheRoot)
	}
	if err := identity.ValidateNodeName(l.Site); err != nil {
		return fmt.Errorf("layout: site: %w", err)
	}
	return nil
}

// SiteRoot is the site's directory under the state dir.
func (l Layout) SiteRoot() string { return filepath.Join(l.StateDir, "sites", l.Site) }

// NodeDir is node's folder in the site root.
func (l Layout) NodeDir(node string) string {
	return filepath.Join(l.SiteRoot(), "nodes", node)
}

// SiteCache is the site's node-local workload cache directory.
func (l Layout) SiteCache() string { return filepath.Join(l.CacheRoot, l.Site) }

// NodeCache is node's workload cache directory within the site's.
func (l Layout) NodeCache(node string) string { return filepath.Join(l.SiteCache(), node) }
