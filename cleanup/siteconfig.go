package cleanup

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"github.com/infermesh/infermesh/config"
	"github.com/infermesh/infermesh/internal/defaults"

	"go.yaml.in/yaml/v3"

	"github.com/infermesh/infermesh/identity"
)

// ErrConfigUnreadable wraps every reason a site's configuration could not
// be read. A cleanup of such a site selects every binding kind, each bound.
var ErrConfigUnreadable = errors.New("configuration cannot be read")

// SiteConfig is what a stopped-site operation needs from the agent's
// configuration file: the site's identity, where it keeps things, and the
// runtime binding kinds its roles use.
type SiteConfig struct {
	Path        string
	Site        string
	Node        string
	StateDir    string
	CacheRoot   string
	AdminSocket string
	// AdminGroup is admin.group: the group that may use the admin socket
	// to change things ("" when none).
	AdminGroup string
	// Bound is the set of binding kinds the roles' instances declare.
	Bound KindSet
}

// Layout is where the site keeps things.
func (c SiteConfig) Layout() Layout {
	return Layout{StateDir: c.StateDir, CacheRoot: c.CacheRoot, Site: c.Site}
}

// ReadSiteConfig reads the agent's configuration file at path for a
// stopped-site operation. See ParseSiteConfig.
func ReadSiteConfig(path string) (SiteConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return SiteConfig{}, fmt.Errorf("%w: %w", ErrConfigUnreadable, err)
	}
	c, err := ParseSiteConfig(data)
	if err != nil {
		return SiteConfig{}, fmt.Errorf("config %s: %w", path, err)
	}
	c.Path = path
	return c, nil
}

// ParseSiteConfig reads what a stopped-site operation needs from a
// configuration, with the agent's defaults. It is lenient where the agent
// is strict: keys it does not need are ignored, so a configuration written
// for another version still says which site this is and what it binds. An
// instance's runtime key that this version does not know is an
// *UnknownBindingError naming the field; data that is not a configuration
// at all wraps ErrConfigUnreadable.
func ParseSiteConfig(data []byte) (SiteConfig, error) {
	var raw struct {
		Site string `yaml:"site"`
		Node struct {
			Name     string `yaml:"name"`
			StateDir string `yaml:"state_dir"`
			CacheDir string `yaml:"cache_dir"`
		} `yaml:"node"`
		Admin struct {
			Socket string `yaml:"socket"`
			Group  string `yaml:"group"`
		} `yaml:"admin"`
		Roles map[string]struct {
			Instance *struct {
				Runtime string `yaml:"runtime"`
			} `yaml:"instance"`
		} `yaml:"roles"`
	}
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&raw); err != nil && !errors.Is(err, io.EOF) {
		return SiteConfig{}, fmt.Errorf("%w: %w", ErrConfigUnreadable, err)
	}
	c := SiteConfig{
		Site:        raw.Site,
		Node:        raw.Node.Name,
		StateDir:    raw.Node.StateDir,
		CacheRoot:   raw.Node.CacheDir,
		AdminSocket: raw.Admin.Socket,
		AdminGroup:  raw.Admin.Group,
	}
	if err := c.fill(); err != nil {
		return SiteConfig{}, fmt.Errorf("%w: %w", ErrConfigUnreadable, err)
	}
	roles := make([]string, 0, len(raw.Roles))
	for name := range raw.Roles {
		roles = append(roles, name)
	}
	slices.Sort(roles)
	for _, name := range roles {
		in := raw.Roles[name].Instance
		if in == nil {
			continue // a static upstream binds no runtime
		}
		k, err := ParseKind(in.Runtime)
		if err != nil {
			return SiteConfig{}, fmt.Errorf("roles.%s.instance.runtime: %w", name, err)
		}
		c.Bound.Add(k)
	}
	return c, nil
}

// fill applies the agent's defaults and checks the identity: the site and
// node names become path elements.
func (c *SiteConfig) fill() error {
	defaults.Zero(&c.Site, config.DefaultSite)
	if c.Node == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("node.name: not set and the host name is unknown: %w", err)
		}
		c.Node = h
	}
	defaults.Zero(&c.StateDir, config.DefaultStateDir)
	defaults.Zero(&c.CacheRoot, config.DefaultCacheDir)
	defaults.Zero(&c.AdminSocket, config.DefaultAdminSocket)
	if err := identity.ValidateNodeName(c.Site); err != nil {
		return fmt.Errorf("site: %w", err)
	}
	if err := identity.ValidateNodeName(c.Node); err != nil {
		return fmt.Errorf("node.name: %w", err)
	}
	for field, dir := range map[string]string{"node.state_dir": c.StateDir, "node.cache_dir": c.CacheRoot} {
		if !filepath.IsAbs(dir) {
			return fmt.Errorf("%s: %q is not an absolute path", field, dir)
		}
	}
	return nil
}

// SelectKinds is the binding kinds a stopped-site operation selects, given
// what ReadSiteConfig returned: the configuration's own, or every kind when
// it could not be read (then every runtime is bound: none may be skipped).
// An unknown binding is returned as is: nothing may proceed.
func SelectKinds(c SiteConfig, readErr error) (KindSet, error) {
	switch {
	case readErr == nil:
		return c.Bound, nil
	case errors.Is(readErr, ErrConfigUnreadable):
		return AllKinds(), nil
	default:
		return KindSet{}, readErr
	}
}
