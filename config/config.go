// Package config holds what the agent's configuration and every tool that
// reads or writes one share: the defaults of where things live on a host.
// The agent (its YAML schema), the CLI, site cleanup and node bootstrap
// all take them from here, so a default is written once.
//
// It is a leaf: it imports nothing of infermesh's.
package config

// Defaults of the places a node keeps things (the config's node.state_dir,
// node.cache_dir, admin.socket and site), and of the config file itself.
const (
	// DefaultDir is the directory of the config file.
	DefaultDir = "/etc/infermesh"
	// DefaultFile is the config file infermeshd reads and the CLI's site
	// commands read when --config does not say.
	DefaultFile = DefaultDir + "/infermesh.yaml"
	// DefaultStateDir is node.state_dir: the node key, the state store, the
	// gossip keyring, the site roots.
	DefaultStateDir = "/var/lib/infermesh"
	// DefaultCacheDir is node.cache_dir: native instances' caches (the
	// systemd unit's CacheDirectory).
	DefaultCacheDir = "/var/cache/infermesh"
	// DefaultAdminSocket is admin.socket, the CLI's default socket.
	DefaultAdminSocket = "/run/infermesh/admin.sock"
	// DefaultSite is the site name when the config names none.
	DefaultSite = "default"
)
