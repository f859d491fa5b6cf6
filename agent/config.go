package agent

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
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
	// Telemetry exports traces; off by default.
	Telemetry TelemetryConfig `yaml:"telemetry"`

	// path is the file the config was loaded from ("" when built in code).
	path string `reload:"-"`
}

// TelemetryConfig exports traces of the requests over OTLP/HTTP (package
// telemetry).
type TelemetryConfig struct {
	// OTLPEndpoint is the collector's OTLP/HTTP traces URL, e.g.
	// http://127.0.0.1:4318/v1/traces (no path: /v1/traces). Empty: no
	// tracing (the default).
	OTLPEndpoint string `yaml:"otlp_endpoint" reload:"restart"`
	// Sample is the fraction of new traces recorded (0 to 1; default 1).
	// A request whose traceparent is sampled is always recorded.
	Sample float64 `yaml:"sample" reload:"restart"`
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
	// Console is an optional loopback host:port serving the read-only web
	// console; `infermesh console` prints its URL with the token the agent
	// makes at each start (kept in <state_dir>/console.token, 0600).
	// Default off.
	Console string `yaml:"console" reload:"restart"`
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
	// Metrics says where the static upstream's capacity comes from: auto
	// (default: llama.cpp's or vLLM's /metrics, whichever it serves),
	// llamacpp, vllm, or none (the agent's own count). A managed instance
	// has instance.metrics.
	Metrics string `yaml:"metrics" reload:"live"`
	// Capacity is how many requests the instance runs at once (its slots),
	// when its metrics do not say (vLLM, or none); 0: unknown, or from
	// llama.cpp's /slots.
	Capacity int `yaml:"capacity" reload:"live"`
	// Routing is how requests for the role choose among its candidates.
	Routing RoutingConfig `yaml:"routing"`

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

// RoutingConfig is how a role's requests choose among the local instance
// and the peers that serve the role (package routing).
type RoutingConfig struct {
	// Policy is auto (default: by estimated time to first token, with
	// locality and per-tenant affinity), local-first (the local instance,
	// then peers by load: the seed's order) or least-loaded.
	Policy string `yaml:"policy" reload:"live"`
	// Affinity is how policy auto places a tenant's key: bounded (default:
	// rendezvous order, bounded by each node's fair share of the recent
	// requests, the local instance a node among them) or rendezvous (the
	// plain rendezvous peer, the local instance kept for what it holds).
	Affinity string `yaml:"affinity" reload:"live"`
	// Margin is how much worse than the best a candidate's estimate may be
	// and it is still kept for locality or affinity: Absolute or Relative
	// times the best, whichever is more lenient. Defaults 50ms and 1.5.
	Margin RoutingMargin `yaml:"margin"`
	// Queue holds requests at this agent while every candidate is full.
	Queue RoutingQueue `yaml:"queue"`
}

// RoutingMargin is routing.margin.
type RoutingMargin struct {
	Absolute time.Duration `yaml:"absolute" reload:"live"`
	Relative float64       `yaml:"relative" reload:"live"`
}

// RoutingQueue is routing.queue: at most Max requests wait, each at most
// Timeout, for a candidate to free a slot; then 503 server_busy with
// Retry-After. Max 0 (default): none wait at this agent.
type RoutingQueue struct {
	Max     int           `yaml:"max" reload:"live"`
	Timeout time.Duration `yaml:"timeout" reload:"live"`
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
	Health string `yaml:"health" reload:"instance"`
	// Metrics: as roles.<r>.metrics, for the managed instance.
	Metrics string        `yaml:"metrics" reload:"live"`
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
