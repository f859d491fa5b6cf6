package agent

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/infermesh/infermesh/config"

	"github.com/infermesh/infermesh/enginestat"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/proxy"
	"github.com/infermesh/infermesh/routing"
)

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
	defaults.Zero(&c.Node.StateDir, config.DefaultStateDir)
	defaults.Zero(&c.Node.CacheDir, config.DefaultCacheDir)
	if !filepath.IsAbs(c.Node.CacheDir) {
		return fieldErr("node.cache_dir", "%q must be an absolute path", c.Node.CacheDir)
	}
	defaults.Zero(&c.Site, config.DefaultSite)
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
	defaults.Zero(&c.Admin.Socket, config.DefaultAdminSocket)
	if m := c.Admin.Metrics; m != "" && !loopbackHostPort(m) {
		if !c.Admin.MetricsAllowRemote {
			return fieldErr("admin.metrics", "%q is not a loopback host:port; set admin.metrics_allow_remote: true to serve metrics to the network", m)
		}
		if _, p, err := net.SplitHostPort(m); err != nil || p == "" {
			return fieldErr("admin.metrics", "%q is not host:port", m)
		}
	}
	if t := c.Telemetry; t.OTLPEndpoint != "" {
		if u, err := url.Parse(t.OTLPEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fieldErr("telemetry.otlp_endpoint", "%q is not an http(s) URL (e.g. http://127.0.0.1:4318/v1/traces)", t.OTLPEndpoint)
		}
	}
	if s := c.Telemetry.Sample; s < 0 || s > 1 {
		return fieldErr("telemetry.sample", "%v is not within 0 and 1", s)
	}
	if a := c.Admin.Console; a != "" && !loopbackHostPort(a) && !loopbackAnyPort(a) {
		return fieldErr("admin.console", "%q is not a loopback host:port (the console is served on loopback only)", a)
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
		if !enginestat.ValidMode(r.Metrics) {
			return fieldErr(f+".metrics", "%q is none of auto, llamacpp, vllm, none", r.Metrics)
		}
		if r.Instance != nil && !enginestat.ValidMode(r.Instance.Metrics) {
			return fieldErr(f+".instance.metrics", "%q is none of auto, llamacpp, vllm, none", r.Instance.Metrics)
		}
		if r.Metrics != "" && r.Instance != nil {
			return fieldErr(f+".metrics", "is for a static upstream; a managed instance has instance.metrics")
		}
		if err := r.Routing.validate(f + ".routing"); err != nil {
			return err
		}
		if r.Capacity < 0 || r.Capacity > 1<<20 {
			return fieldErr(f+".capacity", "%d is not a slot count (0 to %d; 0: unknown)", r.Capacity, 1<<20)
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
	defaults.Zero(&m.Cluster, DefaultCluster)
	if err := validNodeName(m.Cluster); err != nil {
		return fieldErr("mesh.cluster", "%v", err)
	}
	defaults.Zero(&m.GossipKeyring, DefaultKeyring)
	if m.AdvertTTL < 0 {
		return fieldErr("mesh.advert_ttl", "%v is negative", m.AdvertTTL)
	}
	defaults.Zero(&m.AdvertTTL, placement.DefaultAdvertTTL)
	if m.MaxStreamsPerPeer < 0 {
		return fieldErr("mesh.max_streams_per_peer", "%d is negative", m.MaxStreamsPerPeer)
	}
	defaults.Zero(&m.MaxStreamsPerPeer, mesh.DefaultMaxStreamsPerPeer)
	if m.MaxConnsPerPeer < 0 {
		return fieldErr("mesh.max_conns_per_peer", "%d is negative", m.MaxConnsPerPeer)
	}
	defaults.Zero(&m.MaxConnsPerPeer, mesh.DefaultMaxConnsPerPeer)
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
	defaults.Zero(&p.ShutdownTimeout, defaultShutdown)
	defaults.Zero(&p.HealthInterval, defaultHealthPeriod)
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
	defaults.Zero(&in.Health, "/health")
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
	defaults.Zero(&in.StartupTimeout, defaultStartupTimeout)
	if in.Restart.Max < 0 {
		return fieldErr(f+".restart.max", "%d is negative", in.Restart.Max)
	}
	defaults.Zero(&in.Restart.Max, 5)
	defaults.Positive(&in.Restart.Window, 10*time.Minute)
	defaults.Positive(&in.Restart.Backoff, 2*time.Second)
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

// loopbackAnyPort: hp is a loopback host with port 0 (a free port, which
// the console reports: `infermesh console`).
func loopbackAnyPort(hp string) bool {
	h, p, err := net.SplitHostPort(hp)
	return err == nil && p == "0" && loopbackHostPort(net.JoinHostPort(h, "1"))
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

// maxRouteQueue bounds routing.queue.max.
const maxRouteQueue = 1 << 16

func (c RoutingConfig) validate(f string) error {
	if c.Policy != "" {
		if _, err := routing.ParsePolicy(c.Policy); err != nil {
			return fieldErr(f+".policy", "%q is none of auto, local-first, least-loaded", c.Policy)
		}
	}
	if c.Affinity != "" && c.Affinity != "bounded" && c.Affinity != "rendezvous" {
		return fieldErr(f+".affinity", "%q is neither bounded nor rendezvous", c.Affinity)
	}
	if c.Margin.Absolute < 0 {
		return fieldErr(f+".margin.absolute", "%v is negative", c.Margin.Absolute)
	}
	if m := c.Margin.Relative; m != 0 && (m < 1 || m > 100 || m != m) {
		return fieldErr(f+".margin.relative", "%v is not a factor from 1 to 100", m)
	}
	if c.Queue.Max < 0 || c.Queue.Max > maxRouteQueue {
		return fieldErr(f+".queue.max", "%d is not from 0 to %d", c.Queue.Max, maxRouteQueue)
	}
	if c.Queue.Timeout < 0 {
		return fieldErr(f+".queue.timeout", "%v is negative", c.Queue.Timeout)
	}
	if c.Queue.Timeout > 0 && c.Queue.Max == 0 {
		return fieldErr(f+".queue.timeout", "set without queue.max: no request waits")
	}
	return nil
}

// routeConfig is the proxy's view of c.
func (c RoutingConfig) routeConfig() proxy.RouteConfig {
	pol, _ := routing.ParsePolicy(c.Policy) // validated; "" is auto
	if c.Policy == "" {
		pol = routing.PolicyAuto
	}
	p := routing.DefaultParams()
	if c.Margin.Absolute > 0 {
		p.AbsMargin = c.Margin.Absolute
	}
	if c.Margin.Relative > 0 {
		p.RelMargin = c.Margin.Relative
	}
	return proxy.RouteConfig{Policy: pol, Params: p, QueueMax: c.Queue.Max, QueueTimeout: c.Queue.Timeout, PlainAffinity: c.Affinity == "rendezvous"}
}
