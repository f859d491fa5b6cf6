package agent

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
)

// Config is the agent's configuration file (YAML). Decoding is strict: an
// unknown key is an error naming the key and its line. See configs/ for
// annotated examples and docs/configuration.md for the reference. Every field's
// `reload` tag says how a reload applies a change of it (configdiff.go).
type Config struct {
	Node  NodeConfig            `yaml:"node"`
	Site  string                `yaml:"site" reload:"restart"`
	Log   LogConfig             `yaml:"log"`
	Mesh  MeshConfig            `yaml:"mesh"`
	Trust TrustConfig           `yaml:"trust"`
	Admin AdminConfig           `yaml:"admin"`
	Proxy ProxyConfig           `yaml:"proxy"`
	Roles map[string]RoleConfig `yaml:"roles" reload:"role"`

	// path is the file the config was loaded from ("" when built in code).
	path string `reload:"-"`
}

// NodeConfig names this node and where it keeps its state.
type NodeConfig struct {
	// Name is the node's mesh identity. Default: the host name.
	Name string `yaml:"name" reload:"restart"`
	// StateDir holds the node key, the state store and the gossip keyring,
	// and the site root (sites/<site>: native instances' records and logs).
	// Default /var/lib/infermesh.
	StateDir string `yaml:"state_dir" reload:"restart"`
	// CacheDir holds node-local workload caches, one directory per site
	// (<cache_dir>/<site>/<node>/<role>: a native instance's working
	// directory and HOME). Default /var/cache/infermesh.
	CacheDir string `yaml:"cache_dir" reload:"restart"`
}

// LogConfig selects the log format and level.
type LogConfig struct {
	// Level: debug, info, warn, error. Default info.
	Level string `yaml:"level" reload:"restart"`
	// Format: json (default) or console.
	Format string `yaml:"format" reload:"restart"`
}

// MeshConfig configures gossip and the QUIC transport. Leaving Bind empty
// runs the node without a mesh: only local instances serve.
type MeshConfig struct {
	// Cluster names the mesh; nodes of another cluster are refused.
	// Default "infermesh".
	Cluster string `yaml:"cluster" reload:"restart"`
	// Bind is the memberlist address (UDP and TCP), e.g. 127.0.0.1:7946.
	Bind string `yaml:"bind" reload:"restart"`
	// Advertise is the gossip address peers use, when not Bind.
	Advertise string `yaml:"advertise" reload:"restart"`
	// QUIC is the UDP address of the agent-to-agent HTTP/3 listener.
	QUIC string `yaml:"quic" reload:"restart"`
	// QUICAdvertise is the QUIC address peers dial, when not QUIC.
	QUICAdvertise string `yaml:"quic_advertise" reload:"restart"`
	// Join lists gossip addresses of existing members. Empty is a valid
	// single-node mesh.
	Join []string `yaml:"join" reload:"restart"`
	// GossipKeyring is the AES-256 keyring file, relative to the state dir
	// unless absolute. Default keyring.json.
	GossipKeyring string `yaml:"gossip_keyring" reload:"restart"`
	// AdvertTTL is how long a peer's advert counts without a newer one.
	// Default 60s.
	AdvertTTL time.Duration `yaml:"advert_ttl" reload:"restart"`
	// MaxStreamsPerPeer bounds the requests one peer may have in flight to
	// this node at once, across all of its QUIC connections. On one
	// connection (an agent keeps one) more wait for a free stream; beyond
	// it across connections they are answered 503. Default 4096.
	MaxStreamsPerPeer int64 `yaml:"max_streams_per_peer" reload:"restart"`
	// MaxConnsPerPeer bounds the QUIC connections one peer may hold to this
	// node at once; another is closed after its handshake (and audited).
	// Default 4.
	MaxConnsPerPeer int `yaml:"max_conns_per_peer" reload:"restart"`
}

// Enabled reports whether the mesh is configured.
func (m MeshConfig) Enabled() bool { return m.Bind != "" }

// TrustConfig says which nodes are admitted.
type TrustConfig struct {
	// Authority is the base64 ed25519 public key that signs admission
	// certificates.
	Authority string `yaml:"authority" reload:"trust,secret"`
	// Certificate is this node's admission certificate (base64), or a file
	// path relative to the state dir when it names one.
	Certificate string `yaml:"certificate" reload:"restart,secret"`
	// Nodes is a static list of trusted nodes.
	Nodes []TrustedNode `yaml:"nodes" reload:"trust"`
	// Revoked lists node names or base64 public keys that are never
	// admitted, whatever vouches for them.
	Revoked []string `yaml:"revoked" reload:"trust,set"`
}

// TrustedNode is one statically trusted node.
type TrustedNode struct {
	Name      string `yaml:"name" reload:"trust"`
	PublicKey string `yaml:"public_key" reload:"trust,secret"`
	// Scope is full (may serve roles, default) or consumer.
	Scope string `yaml:"scope" reload:"trust"`
}

// AdminConfig configures the admin socket.
type AdminConfig struct {
	// Socket is the admin Unix socket path. Default /run/infermesh/admin.sock.
	Socket string `yaml:"socket" reload:"restart"`
	// Group may change things through the socket (besides root and the
	// agent's own user). Others may only read.
	Group string `yaml:"group" reload:"restart"`
	// Metrics is an optional TCP address serving /metrics, /health and
	// /ready; loopback unless MetricsAllowRemote.
	Metrics string `yaml:"metrics" reload:"restart"`
	// MetricsAllowRemote lets Metrics bind off loopback, so a central
	// Prometheus can scrape it. They are served to the network without
	// authentication: firewall the port. Default false.
	MetricsAllowRemote bool `yaml:"metrics_allow_remote" reload:"restart"`
	// PublicRead lets every local user connect to the socket (mode 0666,
	// directory 0755) to read status; changes still need root, the agent's
	// user or the admin group. Default false: the socket is 0660 and only
	// the owner and the group can connect at all.
	PublicRead bool `yaml:"public_read" reload:"restart"`
}

// ProxyConfig tunes the loopback proxy.
type ProxyConfig struct {
	// Listen is an optional loopback host:port serving every role at once:
	// a request goes to the role its model names (a role, or a model an
	// instance of a role serves). The role ports stay.
	Listen string `yaml:"listen" reload:"restart"`
	// MaxBodyBytes limits request bodies. Default 16 MiB.
	MaxBodyBytes int64 `yaml:"max_body_bytes" reload:"restart"`
	// ConnectTimeout bounds connecting to an instance or peer. Default 2s.
	ConnectTimeout time.Duration `yaml:"connect_timeout" reload:"restart"`
	// PeerFirstByteTimeout bounds how long a peer agent that answers
	// nothing holds a remote attempt: after a third of it without response
	// headers the consumer asks that agent, over the same QUIC connection,
	// whether it is alive, and waits the rest for the answer; a peer that
	// does not answer is cooled down and the next candidate is tried. A
	// peer that answers (a slow model) is waited for, and asked again
	// every period. Default 750ms.
	PeerFirstByteTimeout time.Duration `yaml:"peer_first_byte_timeout" reload:"restart"`
	// UpstreamTimeout bounds the wait for response headers. Default 5m.
	UpstreamTimeout time.Duration `yaml:"upstream_timeout" reload:"restart"`
	// ShutdownTimeout bounds draining in-flight requests at stop.
	// Default 30s.
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout" reload:"live"`
	// HealthInterval is how often static upstreams are probed. Default 2s.
	HealthInterval time.Duration `yaml:"health_interval" reload:"restart"`
	// MaxBodyMemory bounds the memory of request bodies in flight, all
	// role ports together; above it requests get 503 and Retry-After.
	// Default 256 MiB.
	MaxBodyMemory int64 `yaml:"max_body_memory" reload:"restart"`
	// MaxConns caps the client connections of all role ports together.
	// Default: from the open-file limit, (limit - 256) / 2.
	MaxConns int `yaml:"max_conns" reload:"restart"`
	// BodyTimeout bounds reading a request body. Default 60s.
	BodyTimeout time.Duration `yaml:"body_timeout" reload:"restart"`
	// Server selects the HTTP implementation of the role ports and of
	// the client of local instances: infermesh (default, built for
	// speed) or std (net/http's, the known-good fallback).
	Server string `yaml:"server" reload:"restart"`
	// WriteTimeout bounds each write to a client (a client that stops
	// reading a stream is cut after it). Default 60s.
	WriteTimeout time.Duration `yaml:"write_timeout" reload:"restart"`
	// AccessLog logs one line per request (logger "access", level info):
	// request id, source, role, model, the node that served it, status,
	// duration, time to first byte, bytes. Default true.
	AccessLog *bool `yaml:"access_log" reload:"restart"`
	// AccessLogSample is the fraction of successful requests logged;
	// errors and aborted streams always are. Default 1.
	AccessLogSample *float64 `yaml:"access_log_sample" reload:"restart"`
}

// AccessLogOn reports whether the access log is on (the default).
func (p ProxyConfig) AccessLogOn() bool { return p.AccessLog == nil || *p.AccessLog }

// AccessLogSkip is the fraction of successful requests left out.
func (p ProxyConfig) AccessLogSkip() float64 {
	if p.AccessLogSample == nil {
		return 0
	}
	return 1 - *p.AccessLogSample
}

// RoleConfig is one `infer.<role>`.
type RoleConfig struct {
	// Port is the loopback port apps use for this role.
	Port int `yaml:"port" reload:"role"`
	// Upstream is a static local instance, http://<loopback>:<port>.
	Upstream string `yaml:"upstream" reload:"role"`
	// Model is the model the instance knows; requests are pinned to it.
	// Default for a simulated instance: SimulatedModel.
	Model string `yaml:"model" reload:"role"`
	// Expose allows the role to leave loopback at all (serve to peers).
	Expose bool `yaml:"expose" reload:"policy"`
	// ServeTo lists the peers this node serves the role to (default deny).
	ServeTo []string `yaml:"serve_to" reload:"policy,set"`
	// AcceptFrom lists the nodes allowed to serve the role to this node
	// (default deny).
	AcceptFrom []string `yaml:"accept_from" reload:"policy,set"`
	// Instance is a managed local instance: a Docker container, a native
	// process, or the simulated (built-in demo) model.
	Instance *InstanceConfig `yaml:"instance" reload:"instance"`
	// UpstreamAPIKeyFile holds the API key the local instance requires
	// (vLLM --api-key, a LiteLLM master key): sent as Authorization:
	// Bearer on every request to it, an app's or a peer's. Read when the
	// config is loaded or reloaded; a file other users can read is refused.
	UpstreamAPIKeyFile string `yaml:"upstream_api_key_file" reload:"live"`

	upstreamKey string `reload:"live,secret,from=upstream_api_key_file"` // read from UpstreamAPIKeyFile by Validate; never logged
}

// UpstreamKey is the key read from UpstreamAPIKeyFile ("" without one).
func (r RoleConfig) UpstreamKey() string { return r.upstreamKey }

// maxUpstreamKey bounds an upstream API key file.
const maxUpstreamKey = 4096

// readUpstreamKey reads an API key file: an absolute path, a regular file
// no other user can read, one non-empty line of printable characters.
func readUpstreamKey(f, path string) (string, error) {
	if !filepath.IsAbs(path) {
		return "", fieldErr(f, "%q is not an absolute path", path)
	}
	fh, err := os.Open(path)
	if err != nil {
		return "", fieldErr(f, "%v", err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return "", fieldErr(f, "%v", err)
	}
	if !st.Mode().IsRegular() {
		return "", fieldErr(f, "%s is not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o007 != 0 {
		return "", fieldErr(f, "%s is accessible by every user (mode %04o); chmod o-rwx %s", path, perm, path)
	}
	data, err := io.ReadAll(io.LimitReader(fh, maxUpstreamKey+1))
	if err != nil {
		return "", fieldErr(f, "%v", err)
	}
	if len(data) > maxUpstreamKey {
		return "", fieldErr(f, "%s is over %d bytes; it must hold the key alone", path, maxUpstreamKey)
	}
	key := strings.TrimSpace(string(data))
	if key == "" {
		return "", fieldErr(f, "%s is empty", path)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c <= ' ' || c == 0x7f {
			return "", fieldErr(f, "%s: the key must be one line without spaces or control characters", path)
		}
	}
	return key, nil
}

// InstanceConfig describes a managed local instance.
type InstanceConfig struct {
	// Runtime is docker (default), native or simulated.
	Runtime string `yaml:"runtime" reload:"instance"`
	// Image is the container image (docker).
	Image string `yaml:"image" reload:"instance"`
	// Command is the executable, an absolute path (native).
	Command string            `yaml:"command" reload:"instance"`
	Args    []string          `yaml:"args" reload:"instance,secret"` // may hold a key (--api-key)
	Env     map[string]string `yaml:"env" reload:"instance,secret"`  // may hold a token (HF_TOKEN)
	// Port is the port the server listens on: inside the container
	// (docker), or on 127.0.0.1 (native).
	Port   int     `yaml:"port" reload:"instance"`
	Mounts []Mount `yaml:"mounts" reload:"instance"`
	// Health is the readiness path. Default /health.
	Health  string        `yaml:"health" reload:"instance"`
	Restart RestartPolicy `yaml:"restart"`
	// GPUs the container may use (docker): all, a count, or device ids.
	GPUs GPUs `yaml:"gpus" reload:"instance"`
	// ShmSize is the container's /dev/shm (docker), e.g. 8g; inference
	// servers share tensors through it. Default the engine's 64m.
	ShmSize ByteSize `yaml:"shm_size" reload:"instance"`
	// Memory limits the container's memory (docker), e.g. 32g.
	Memory ByteSize `yaml:"memory" reload:"instance"`
	// CPUs limits the container's CPU time (docker), e.g. 4 or 0.5.
	CPUs float64 `yaml:"cpus" reload:"instance"`
	// StopWithAgent stops the instance when the agent stops. Default
	// false: instances outlive the agent (a restart or an upgrade adopts
	// them without a gap); `infermesh instances stop ROLE` stops one.
	StopWithAgent bool `yaml:"stop_with_agent" reload:"live"`
	// StartupTimeout is how long the server may take to answer Health
	// after it starts (loading a large model can take minutes) before it is
	// restarted. Default 2m.
	StartupTimeout time.Duration `yaml:"startup_timeout" reload:"instance"`
}

// Mount is a bind mount into an instance.
type Mount struct {
	Host      string `yaml:"host" reload:"instance"`
	Container string `yaml:"container" reload:"instance"`
	ReadOnly  bool   `yaml:"readonly" reload:"instance"`
}

// RestartPolicy bounds restarts of a failed instance.
type RestartPolicy struct {
	// Max restarts within Window before giving up. Default 5.
	Max int `yaml:"max" reload:"instance"`
	// Window over which restarts are counted. Default 10m.
	Window time.Duration `yaml:"window" reload:"instance"`
	// Backoff before a restart, doubled each time. Default 2s.
	Backoff time.Duration `yaml:"backoff" reload:"instance"`
}

// Defaults.
const (
	DefaultStateDir     = cleanup.DefaultStateDir
	DefaultCacheDir     = cleanup.DefaultCacheRoot
	DefaultAdminSocket  = cleanup.DefaultAdminSocket
	DefaultSite         = cleanup.DefaultSite
	DefaultCluster      = "infermesh"
	DefaultKeyring      = "keyring.json"
	defaultShutdown     = 30 * time.Second
	defaultHealthPeriod = 2 * time.Second
	// SimulatedModel is the model of a simulated instance whose role names
	// none: the built-in demo model's own name.
	SimulatedModel = "demo"
	// defaultStartupTimeout is provision's ReadyTimeout default.
	defaultStartupTimeout = 2 * time.Minute
)

// FieldError is a configuration error naming the offending field.
type FieldError struct {
	Field string
	Msg   string

	cause error // what Msg says, when it came from elsewhere (a file's read)
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// Unwrap returns the error the message reports, if any.
func (e *FieldError) Unwrap() error { return e.cause }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// LoadConfig reads, strictly decodes, defaults and validates a config file.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	cfg.path = path
	return cfg, nil
}

// ParseConfig strictly decodes, defaults and validates YAML config data.
func ParseConfig(data []byte) (*Config, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, syntaxError(data, err)
	}
	if err := checkKeys(&doc, reflect.TypeFor[Config]()); err != nil {
		return nil, err
	}
	cfg := &Config{}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil && !errors.Is(err, io.EOF) { // io.EOF: an empty file
		return nil, friendlyYAMLError(err)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// DevConfig is the configuration of `infermeshd -dev`: one node, no mesh,
// role chat on 127.0.0.1:18080 served by the built-in demo model (its
// upstream is filled in once the demo listens).
func DevConfig(stateDir string) (*Config, error) {
	cfg := &Config{
		Node:  NodeConfig{Name: "dev", StateDir: stateDir},
		Log:   LogConfig{Format: "console"},
		Admin: AdminConfig{Socket: stateDir + "/admin.sock"},
		Roles: map[string]RoleConfig{
			"chat": {Port: 18080, Model: "demo"},
		},
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// Path returns the file the config was loaded from.
func (c *Config) Path() string { return c.path }

// Validate fills defaults and checks every field, naming the first bad one.
func (c *Config) Validate() error {
	if c.Node.Name == "" {
		h, err := os.Hostname()
		if err != nil {
			return fieldErr("node.name", "not set and the host name is unknown: %v", err)
		}
		c.Node.Name = h
	}
	if err := validNodeName(c.Node.Name); err != nil {
		return fieldErr("node.name", "%v", err)
	}
	c.Node.StateDir = cmp.Or(c.Node.StateDir, DefaultStateDir)
	c.Node.CacheDir = cmp.Or(c.Node.CacheDir, DefaultCacheDir)
	if !filepath.IsAbs(c.Node.CacheDir) {
		return fieldErr("node.cache_dir", "%q must be an absolute path", c.Node.CacheDir)
	}
	c.Site = cmp.Or(c.Site, DefaultSite)
	if err := validNodeName(c.Site); err != nil {
		return fieldErr("site", "%v", err)
	}
	switch c.Log.Level {
	case "", "debug", "info", "warn", "error":
	default:
		return fieldErr("log.level", "%q is not one of debug, info, warn, error", c.Log.Level)
	}
	switch c.Log.Format {
	case "":
		c.Log.Format = "json"
	case "json", "console":
	default:
		return fieldErr("log.format", "%q is not json or console", c.Log.Format)
	}
	if err := c.Mesh.validate(); err != nil {
		return err
	}
	if err := c.Trust.validate(); err != nil {
		return err
	}
	if _, err := c.MeshTrust(); err != nil { // every key must parse, named by field
		return err
	}
	c.Admin.Socket = cmp.Or(c.Admin.Socket, DefaultAdminSocket)
	if m := c.Admin.Metrics; m != "" && !loopbackHostPort(m) {
		if !c.Admin.MetricsAllowRemote {
			return fieldErr("admin.metrics", "%q is not a loopback host:port; set admin.metrics_allow_remote: true to serve metrics to the network", m)
		}
		if _, p, err := net.SplitHostPort(m); err != nil || p == "" {
			return fieldErr("admin.metrics", "%q is not host:port", m)
		}
	}
	if err := c.Proxy.validate(); err != nil {
		return err
	}
	ports := map[int]string{}
	if c.Proxy.Listen != "" {
		if !loopbackHostPort(c.Proxy.Listen) {
			return fieldErr("proxy.listen", "%q is not a loopback host:port", c.Proxy.Listen)
		}
		_, p, _ := net.SplitHostPort(c.Proxy.Listen)
		n, _ := strconv.Atoi(p)
		ports[n] = "proxy.listen"
	}
	names := make([]string, 0, len(c.Roles))
	for name := range c.Roles {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		r := c.Roles[name]
		f := "roles." + name
		if err := placement.ValidateRole(name); err != nil {
			return fieldErr(f, "%v", err)
		}
		if r.Port == 0 {
			return fieldErr(f+".port", "is required (the loopback port apps use for the role)")
		}
		if r.Port < 1 || r.Port > 65535 {
			return fieldErr(f+".port", "%d is not a port (1-65535)", r.Port)
		}
		if other, dup := ports[r.Port]; dup {
			if other == "proxy.listen" {
				return fieldErr(f+".port", "%d is already used by proxy.listen", r.Port)
			}
			return fieldErr(f+".port", "%d is already used by role %q", r.Port, other)
		}
		ports[r.Port] = name
		if r.Upstream != "" && r.Instance != nil {
			return fieldErr(f, "set either upstream or instance, not both")
		}
		if r.Upstream != "" {
			if err := loopbackBase(r.Upstream); err != nil {
				return fieldErr(f+".upstream", "%v", err)
			}
		}
		if r.Instance != nil {
			if err := r.Instance.validate(f + ".instance"); err != nil {
				return err
			}
			if r.Instance.Runtime == provision.RuntimeSimulated && r.Model == "" {
				// The role pins requests to the model its instance knows:
				// without a model named, both are the demo model's own.
				r.Model = SimulatedModel
			}
		}
		for i, n := range r.ServeTo {
			if err := validNodeName(n); err != nil {
				return fieldErr(fmt.Sprintf("%s.serve_to[%d]", f, i), "%v", err)
			}
		}
		for i, n := range r.AcceptFrom {
			if err := validNodeName(n); err != nil {
				return fieldErr(fmt.Sprintf("%s.accept_from[%d]", f, i), "%v", err)
			}
		}
		r.upstreamKey = ""
		if r.UpstreamAPIKeyFile != "" {
			key, err := readUpstreamKey(f+".upstream_api_key_file", r.UpstreamAPIKeyFile)
			if err != nil {
				return err
			}
			r.upstreamKey = key
		}
		if len(r.ServeTo) > 0 && !r.Expose {
			return fieldErr(f+".serve_to", "lists peers but expose is false; set expose: true to let the role leave loopback")
		}
		c.Roles[name] = r
	}
	return nil
}

func (m *MeshConfig) validate() error {
	m.Cluster = cmp.Or(m.Cluster, DefaultCluster)
	if err := validNodeName(m.Cluster); err != nil {
		return fieldErr("mesh.cluster", "%v", err)
	}
	m.GossipKeyring = cmp.Or(m.GossipKeyring, DefaultKeyring)
	if m.AdvertTTL < 0 {
		return fieldErr("mesh.advert_ttl", "%v is negative", m.AdvertTTL)
	}
	m.AdvertTTL = cmp.Or(m.AdvertTTL, placement.DefaultAdvertTTL)
	if m.MaxStreamsPerPeer < 0 {
		return fieldErr("mesh.max_streams_per_peer", "%d is negative", m.MaxStreamsPerPeer)
	}
	m.MaxStreamsPerPeer = cmp.Or(m.MaxStreamsPerPeer, mesh.DefaultMaxStreamsPerPeer)
	if m.MaxConnsPerPeer < 0 {
		return fieldErr("mesh.max_conns_per_peer", "%d is negative", m.MaxConnsPerPeer)
	}
	m.MaxConnsPerPeer = cmp.Or(m.MaxConnsPerPeer, mesh.DefaultMaxConnsPerPeer)
	for name, v := range map[string]string{"mesh.bind": m.Bind, "mesh.advertise": m.Advertise, "mesh.quic": m.QUIC, "mesh.quic_advertise": m.QUICAdvertise} {
		if v == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(v); err != nil {
			return fieldErr(name, "%q is not host:port", v)
		}
	}
	for i, j := range m.Join {
		if _, _, err := net.SplitHostPort(j); err != nil {
			return fieldErr(fmt.Sprintf("mesh.join[%d]", i), "%q is not host:port", j)
		}
	}
	if m.Bind == "" && (len(m.Join) > 0 || m.QUIC != "") {
		return fieldErr("mesh.bind", "must be set when mesh.join or mesh.quic is")
	}
	if m.Bind != "" && m.QUIC == "" {
		return fieldErr("mesh.quic", "must be set when mesh.bind is (peers forward requests over QUIC)")
	}
	// Peers dial the advertised QUIC address: it must name one host and a
	// fixed port.
	if m.QUIC != "" {
		field, adv := "mesh.quic", m.QUIC
		if m.QUICAdvertise != "" {
			field, adv = "mesh.quic_advertise", m.QUICAdvertise
		}
		h, p, _ := net.SplitHostPort(adv)
		if p == "0" {
			return fieldErr(field, "%q: peers need a fixed port to dial", adv)
		}
		if ip := net.ParseIP(h); h == "" || (ip != nil && ip.IsUnspecified()) {
			return fieldErr(field, "%q is not an address peers can dial; set mesh.quic_advertise", adv)
		}
	}
	return nil
}

func (t *TrustConfig) validate() error {
	seen := map[string]bool{}
	for i, n := range t.Nodes {
		f := fmt.Sprintf("trust.nodes[%d]", i)
		if err := validNodeName(n.Name); err != nil {
			return fieldErr(f+".name", "%v", err)
		}
		if seen[n.Name] {
			return fieldErr(f+".name", "%q is listed twice", n.Name)
		}
		seen[n.Name] = true
		if n.PublicKey == "" {
			return fieldErr(f+".public_key", "is required")
		}
		switch n.Scope {
		case "":
			t.Nodes[i].Scope = "full"
		case "full", "consumer":
		default:
			return fieldErr(f+".scope", "%q is not full or consumer", n.Scope)
		}
	}
	return nil
}

func (p *ProxyConfig) validate() error {
	if p.MaxBodyBytes < 0 {
		return fieldErr("proxy.max_body_bytes", "%d is negative", p.MaxBodyBytes)
	}
	if p.MaxBodyMemory < 0 {
		return fieldErr("proxy.max_body_memory", "%d is negative", p.MaxBodyMemory)
	}
	if p.MaxBodyMemory > 0 && p.MaxBodyMemory < max(p.MaxBodyBytes, 16<<20) {
		return fieldErr("proxy.max_body_memory", "%d is below max_body_bytes (%d): no body of that size could be read", p.MaxBodyMemory, max(p.MaxBodyBytes, 16<<20))
	}
	if p.MaxConns < 0 {
		return fieldErr("proxy.max_conns", "%d is negative", p.MaxConns)
	}
	switch p.Server {
	case "", "infermesh", "std":
	default:
		return fieldErr("proxy.server", "%q is not infermesh or std", p.Server)
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{
		{"proxy.connect_timeout", p.ConnectTimeout}, {"proxy.upstream_timeout", p.UpstreamTimeout},
		{"proxy.peer_first_byte_timeout", p.PeerFirstByteTimeout},
		{"proxy.shutdown_timeout", p.ShutdownTimeout}, {"proxy.health_interval", p.HealthInterval},
		{"proxy.body_timeout", p.BodyTimeout}, {"proxy.write_timeout", p.WriteTimeout},
	} {
		if f.d < 0 {
			return fieldErr(f.name, "%v is negative", f.d)
		}
	}
	if s := p.AccessLogSample; s != nil && (*s < 0 || *s > 1) {
		return fieldErr("proxy.access_log_sample", "%v is not a fraction from 0 to 1", *s)
	}
	p.ShutdownTimeout = cmp.Or(p.ShutdownTimeout, defaultShutdown)
	p.HealthInterval = cmp.Or(p.HealthInterval, defaultHealthPeriod)
	return nil
}

func (in *InstanceConfig) validate(f string) error {
	unused := func(what string, set bool) error {
		if set {
			return fieldErr(f+"."+what, "is not used by runtime %s", in.Runtime)
		}
		return nil
	}
	switch in.Runtime {
	case "":
		in.Runtime = provision.RuntimeDocker
	case provision.RuntimeDocker, provision.RuntimeNative, provision.RuntimeSimulated:
	default:
		return fieldErr(f+".runtime", "%q is not docker, native or simulated", in.Runtime)
	}
	switch in.Runtime {
	case provision.RuntimeDocker:
		if in.Image == "" {
			return fieldErr(f+".image", "is required")
		}
		if err := unused("command", in.Command != ""); err != nil {
			return err
		}
	case provision.RuntimeNative:
		if in.Command == "" {
			return fieldErr(f+".command", "is required")
		}
		if !filepath.IsAbs(in.Command) {
			return fieldErr(f+".command", "%q must be an absolute path", in.Command)
		}
		for _, e := range []error{
			unused("image", in.Image != ""), unused("mounts", len(in.Mounts) > 0), unused("gpus", in.GPUs != ""),
			unused("shm_size", in.ShmSize != 0), unused("memory", in.Memory != 0), unused("cpus", in.CPUs != 0),
		} {
			if e != nil {
				return e
			}
		}
	case provision.RuntimeSimulated:
		// The built-in demo model, served inside the agent.
		for _, e := range []error{
			unused("image", in.Image != ""), unused("command", in.Command != ""), unused("args", len(in.Args) > 0),
			unused("env", len(in.Env) > 0), unused("port", in.Port != 0), unused("mounts", len(in.Mounts) > 0),
			unused("gpus", in.GPUs != ""), unused("shm_size", in.ShmSize != 0), unused("memory", in.Memory != 0), unused("cpus", in.CPUs != 0),
			unused("stop_with_agent", in.StopWithAgent),
		} {
			if e != nil {
				return e
			}
		}
		return nil
	}
	if in.Port == 0 {
		return fieldErr(f+".port", "is required (the port the server listens on)")
	}
	if in.Port < 1 || in.Port > 65535 {
		return fieldErr(f+".port", "%d is not a port (1-65535)", in.Port)
	}
	in.Health = cmp.Or(in.Health, "/health")
	if !strings.HasPrefix(in.Health, "/") {
		return fieldErr(f+".health", "%q must be a path starting with /", in.Health)
	}
	for k := range in.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return fieldErr(f+".env", "%q is not a variable name", k)
		}
	}
	for i, m := range in.Mounts {
		mf := fmt.Sprintf("%s.mounts[%d]", f, i)
		if !strings.HasPrefix(m.Host, "/") {
			return fieldErr(mf+".host", "%q must be an absolute path", m.Host)
		}
		if !strings.HasPrefix(m.Container, "/") {
			return fieldErr(mf+".container", "%q must be an absolute path", m.Container)
		}
	}
	if in.CPUs < 0 {
		return fieldErr(f+".cpus", "%v is negative", in.CPUs)
	}
	if in.StartupTimeout < 0 {
		return fieldErr(f+".startup_timeout", "%v is negative", in.StartupTimeout)
	}
	in.StartupTimeout = cmp.Or(in.StartupTimeout, defaultStartupTimeout)
	if in.Restart.Max < 0 {
		return fieldErr(f+".restart.max", "%d is negative", in.Restart.Max)
	}
	in.Restart.Max = cmp.Or(in.Restart.Max, 5)
	if in.Restart.Window <= 0 {
		in.Restart.Window = 10 * time.Minute
	}
	if in.Restart.Backoff <= 0 {
		in.Restart.Backoff = 2 * time.Second
	}
	return nil
}

// validNodeName is the rule of node, site and cluster names.
func validNodeName(n string) error { return identity.ValidateNodeName(n) }

// loopbackBase checks that s is http://<loopback IP or localhost>:<port>.
// Its errors say what is wrong and what is wanted, not the URL parser's
// words.
func loopbackBase(s string) error {
	const want = "want http://<loopback address>:<port>, e.g. http://127.0.0.1:8081"
	if !strings.Contains(s, "://") {
		if _, _, err := net.SplitHostPort(s); err == nil {
			return fmt.Errorf("%q has no scheme: write %q", s, "http://"+s)
		}
		return fmt.Errorf("%q is not a URL: %s", s, want)
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%q is not a URL: %s", s, want)
	}
	if u.Scheme != "http" {
		return fmt.Errorf("%q must use http:// (the agent talks plain HTTP to an instance on loopback)", s)
	}
	if u.Path != "" && u.Path != "/" {
		return fmt.Errorf("%q must not have a path (the agent adds /v1/...): %s", s, want)
	}
	if u.Port() == "" {
		return fmt.Errorf("%q has no port: %s", s, want)
	}
	if !loopbackHostPort(u.Host) {
		return fmt.Errorf("%q is not a loopback address with a port", s)
	}
	return nil
}

func loopbackHostPort(hp string) bool {
	h, p, err := net.SplitHostPort(hp)
	if err != nil {
		return false
	}
	if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
		return false
	}
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}
