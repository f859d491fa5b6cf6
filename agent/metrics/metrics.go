// Package metrics holds the agent's Prometheus collectors in their own
// registry (never the global one): the proxy's per-request measurements
// (it implements proxy.Observer), refusals, and scrape-time views of the
// placement table and the mesh.
//
// The proxy is on the hot path and benchmarked, so the Observer methods
// resolve label children once per distinct (role, target, code) and keep
// them in a copy-on-write map read without a lock; a request whose labels
// were seen before allocates nothing here.
package metrics

import (
	"errors"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
)

// PlacementSource is read at scrape time. *placement.Table satisfies it.
// Snapshot must be safe for concurrent use.
type PlacementSource interface {
	Snapshot() placement.Snapshot
}

// MeshSource is read at scrape time; the agent adapts the mesh to it.
// Methods must be safe for concurrent use and must not block.
type MeshSource interface {
	// PeerStates counts the mesh members by state (e.g. "admitted",
	// "not_admitted"), this node excluded.
	PeerStates() map[string]int
	// Refusals counts the mesh's refusals by reason since start.
	Refusals() map[string]uint64
	// CertificateExpiry is when this node's admission certificate
	// expires; false when it has none that matters.
	CertificateExpiry() (time.Time, bool)
	// PeerCertExpiries is when each live peer's admission certificate
	// expires, by node; peers without one are left out.
	PeerCertExpiries() map[string]time.Time
}

var _ PlacementSource = (*placement.Table)(nil)

// Config configures Metrics. Zero values mean the defaults.
type Config struct {
	// Version is reported by infermesh_build_info.
	Version string
	// Placement is read at scrape time for adverts, local roles and the
	// generation. Nil: those series are absent.
	Placement PlacementSource
	// LatencyBuckets are the request duration buckets, in seconds.
	// Default: 5ms to ~5min, exponential.
	LatencyBuckets []float64
	// TTFTBuckets are the time-to-first-token buckets, in seconds.
	// Default: 5ms to ~80s, exponential.
	TTFTBuckets []float64
	// RouteQueues gives, at scrape time, how many requests wait in each
	// role's routing queue (proxy.Proxy.QueueLens). Nil: the series is
	// absent.
	RouteQueues func() map[string]int
	// NoRuntimeCollectors leaves out the Go runtime and process
	// collectors (tests that compare whole expositions).
	NoRuntimeCollectors bool
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		LatencyBuckets: prometheus.ExponentialBuckets(0.005, 2.5, 13),
		TTFTBuckets:    prometheus.ExponentialBuckets(0.005, 2.2, 13),
	}
}

// Metrics is the agent's registry and collectors. All methods are safe for
// concurrent use.
type Metrics struct {
	reg *prometheus.Registry

	requests  *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	ttft      *prometheus.HistogramVec
	bytes     *prometheus.CounterVec
	aborted   *prometheus.CounterVec
	attempts  *prometheus.CounterVec
	failovers *prometheus.CounterVec
	streams   *prometheus.GaugeVec
	refusals  *prometheus.CounterVec
	tokens    *prometheus.CounterVec
	capacity  *prometheus.GaugeVec // the local instances' slots, running, waiting
	kvUsage   *prometheus.GaugeVec
	decisions *prometheus.CounterVec // route decisions by role and reason
	queueWait *prometheus.HistogramVec

	byCode   cache[codeKey, prometheus.Counter]
	byTarget cache[targetKey, *targetChildren]
	bySource cache[sourceKey, *sourceChildren]
	byRole   cache[string, prometheus.Gauge]

	mesh      atomic.Pointer[meshHolder]
	instances *instanceCollector
}

type meshHolder struct{ src MeshSource }

type codeKey struct {
	role, target, source string
	code                 int
}

type targetKey struct{ role, target string }

type sourceKey struct{ role, target, source string }

// sourceChildren are the pre-resolved children of one (role, target,
// source).
type sourceChildren struct {
	duration, ttft     prometheus.Observer
	prompt, completion prometheus.Counter
}

// targetChildren are the pre-resolved children of one (role, target).
type targetChildren struct {
	bytes, aborted                       prometheus.Counter
	attemptOK, attemptFailed, attempt503 prometheus.Counter
	failovers                            prometheus.Counter
}

var _ proxy.Observer = (*Metrics)(nil)

// New builds the collectors and registers them in a new registry.
func New(cfg Config) (*Metrics, error) {
	d := DefaultConfig()
	if len(cfg.LatencyBuckets) == 0 {
		cfg.LatencyBuckets = d.LatencyBuckets
	}
	if len(cfg.TTFTBuckets) == 0 {
		cfg.TTFTBuckets = d.TTFTBuckets
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	m := &Metrics{reg: prometheus.NewRegistry(), instances: &instanceCollector{}}
	rt := []string{"role", "target"}
	rts := []string{"role", "target", "source"}
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_requests_total",
		Help: "Requests answered by the proxy, by role, the target that answered (local, a peer node, or none), " +
			"source (app: a local app; peer: a peer agent, served here) and HTTP status.",
	}, []string{"role", "target", "source", "code"})
	m.duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "infermesh_request_duration_seconds",
		Help:    "Total request duration, streams included, by role, target and source.",
		Buckets: cfg.LatencyBuckets,
	}, rts)
	m.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "infermesh_time_to_first_token_seconds",
		Help: "Time from receiving a streamed (SSE) request to relaying the first event of its response " +
			"(the first token), by role, target and source.",
		Buckets: cfg.TTFTBuckets,
	}, rts)
	m.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_tokens_total",
		Help: "Tokens the instances reported in their responses' usage (JSON bodies, the final SSE event), " +
			"by role, target, source and kind (prompt, completion).",
	}, []string{"role", "target", "source", "kind"})
	m.bytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_response_bytes_total",
		Help: "Response body bytes sent to clients, by role and target.",
	}, rt)
	m.aborted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_aborted_responses_total",
		Help: "Responses cut after they started (client gone or target failed mid-stream), by role and target.",
	}, rt)
	m.attempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_upstream_attempts_total",
		Help: "Forwarding attempts, by role, target and outcome (ok, unavailable: answered 503, error: no response).",
	}, []string{"role", "target", "outcome"})
	m.failovers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_failovers_total",
		Help: "Attempts that failed before the response started, by role and the target that failed; the proxy then tries the next candidate, if any.",
	}, rt)
	m.streams = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "infermesh_active_streams",
		Help: "Streaming (SSE) responses in flight, by role.",
	}, []string{"role"})
	m.refusals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_refusals_total",
		Help: "Refusals audited by this agent (placement, peers, the admin socket), by reason.",
	}, []string{"reason"})
	m.capacity = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "infermesh_instance_capacity",
		Help: "The local instance's capacity and use, as its engine's metrics (llama.cpp, vLLM) or the role's capacity say, " +
			"by role and kind: slots (how many it runs at once; 0 unknown), running, waiting (queued at the instance).",
	}, []string{"role", "kind"})
	m.kvUsage = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "infermesh_instance_kv_cache_usage_ratio",
		Help: "The share of the local instance's KV cache in use, 0 to 1, as its engine reports it, by role.",
	}, []string{"role"})
	m.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infermesh_route_decisions_total",
		Help: "Requests routed among more than one candidate, by role and the reason the one that answered was chosen " +
			"(local, affinity, least-ttft, spill, queued, failover, least-loaded, order).",
	}, []string{"role", "reason"})
	m.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "infermesh_route_queue_wait_seconds",
		Help:    "How long requests waited at this agent for a free slot while every candidate was full, by role.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 12),
	}, []string{"role"})
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "infermesh_build_info",
		Help:        "The agent's version.",
		ConstLabels: prometheus.Labels{"version": cfg.Version},
	})
	build.Set(1)

	cs := []prometheus.Collector{
		m.requests, m.duration, m.ttft, m.bytes, m.aborted, m.attempts, m.failovers,
		m.streams, m.refusals, m.tokens, m.capacity, m.kvUsage, m.decisions, m.queueWait,
		build, &scrapeCollector{m: m, placement: cfg.Placement}, m.instances,
	}
	if cfg.RouteQueues != nil {
		cs = append(cs, queueCollector(cfg.RouteQueues))
	}
	if !cfg.NoRuntimeCollectors {
		cs = append(cs, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	for _, c := range cs {
		if err := m.reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("metrics: register"), err)
		}
	}

	m.byCode.make = func(k codeKey) prometheus.Counter {
		return m.requests.WithLabelValues(k.role, k.target, k.source, strconv.Itoa(k.code))
	}
	m.bySource.make = func(k sourceKey) *sourceChildren {
		return &sourceChildren{
			duration:   m.duration.WithLabelValues(k.role, k.target, k.source),
			ttft:       m.ttft.WithLabelValues(k.role, k.target, k.source),
			prompt:     m.tokens.WithLabelValues(k.role, k.target, k.source, "prompt"),
			completion: m.tokens.WithLabelValues(k.role, k.target, k.source, "completion"),
		}
	}
	m.byTarget.make = func(k targetKey) *targetChildren {
		return &targetChildren{
			bytes:         m.bytes.WithLabelValues(k.role, k.target),
			aborted:       m.aborted.WithLabelValues(k.role, k.target),
			attemptOK:     m.attempts.WithLabelValues(k.role, k.target, "ok"),
			attemptFailed: m.attempts.WithLabelValues(k.role, k.target, "error"),
			attempt503:    m.attempts.WithLabelValues(k.role, k.target, "unavailable"),
			failovers:     m.failovers.WithLabelValues(k.role, k.target),
		}
	}
	m.byRole.make = func(role string) prometheus.Gauge { return m.streams.WithLabelValues(role) }
	return m, nil
}

// Registry is the agent's registry.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// SetMesh sets (or, with nil, clears) the mesh read at scrape time. The mesh
// usually starts after the metrics exist.
func (m *Metrics) SetMesh(src MeshSource) {
	if src == nil {
		m.mesh.Store(nil)
		return
	}
	m.mesh.Store(&meshHolder{src: src})
}

// Refused counts one audited refusal.
func (m *Metrics) Refused(reason string) {
	if reason == "" {
		reason = "unknown"
	}
	m.refusals.WithLabelValues(reason).Inc()
}

// targetNone is the target of a request no candidate saw.
const targetNone = "none"

func targetLabel(target string) string {
	if target == "" {
		return targetNone
	}
	return target
}

// Attempt implements proxy.Observer.
func (m *Metrics) Attempt(role, target string, status int, err error, _ time.Duration) {
	c := m.byTarget.get(targetKey{role, targetLabel(target)})
	switch {
	case err != nil || status == 0:
		c.attemptFailed.Inc()
		c.failovers.Inc()
	case status == http.StatusServiceUnavailable:
		c.attempt503.Inc()
		c.failovers.Inc()
	default:
		c.attemptOK.Inc()
	}
}

// Done implements proxy.Observer.
func (m *Metrics) Done(o proxy.Outcome) {
	target := targetLabel(o.Target)
	m.byCode.get(codeKey{o.Role, target, o.Source, o.Status}).Inc()
	c := m.byTarget.get(targetKey{o.Role, target})
	if target != targetNone {
		// A request no candidate saw (refused, or nothing serves the
		// role) took no serving time: it would pull the latency down.
		s := m.bySource.get(sourceKey{o.Role, target, o.Source})
		s.duration.Observe(o.Duration.Seconds())
		if o.FirstEvent > 0 {
			s.ttft.Observe(o.FirstEvent.Seconds())
		}
		if o.Usage {
			s.prompt.Add(float64(o.PromptTokens))
			s.completion.Add(float64(o.CompletionTokens))
		}
	}
	if o.Bytes > 0 {
		c.bytes.Add(float64(o.Bytes))
	}
	if o.Aborted {
		c.aborted.Inc()
	}
	if r := o.Route; r != nil {
		m.decisions.WithLabelValues(o.Role, r.Reason).Inc()
		if r.Reason == "queued" || r.Queued > 0 {
			m.queueWait.WithLabelValues(o.Role).Observe(r.Queued.Seconds())
		}
	}
}

// queueCollector reports the routing queues' lengths at scrape time.
type queueCollector func() map[string]int

var queueDesc = prometheus.NewDesc("infermesh_route_queue_length",
	"Requests waiting at this agent for a free slot while every candidate of the role is full, by role.", []string{"role"}, nil)

func (q queueCollector) Describe(ch chan<- *prometheus.Desc) { ch <- queueDesc }

func (q queueCollector) Collect(ch chan<- prometheus.Metric) {
	for role, n := range q() {
		ch <- prometheus.MustNewConstMetric(queueDesc, prometheus.GaugeValue, float64(n), role)
	}
}

// StreamOpen implements proxy.Observer.
func (m *Metrics) StreamOpen(role string) { m.byRole.get(role).Inc() }

// StreamClose implements proxy.Observer.
func (m *Metrics) StreamClose(role string) { m.byRole.get(role).Dec() }

// cache is a copy-on-write map of pre-resolved label children: reads take
// no lock and allocate nothing; a miss builds the child once under mu.
type cache[K comparable, V any] struct {
	m    atomic.Pointer[map[K]V]
	mu   sync.Mutex
	make func(K) V
}

func (c *cache[K, V]) get(k K) V {
	if p := c.m.Load(); p != nil {
		if v, ok := (*p)[k]; ok {
			return v
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	if old != nil {
		if v, ok := (*old)[k]; ok {
			return v
		}
	}
	var next map[K]V
	if old == nil {
		next = make(map[K]V, 8)
	} else {
		next = make(map[K]V, len(*old)+1)
		for kk, vv := range *old {
			next[kk] = vv
		}
	}
	v := c.make(k)
	next[k] = v
	c.m.Store(&next)
	return v
}

// scrapeCollector reads the placement table and the mesh at scrape time.
type scrapeCollector struct {
	m         *Metrics
	placement PlacementSource
}

var (
	descGeneration = prometheus.NewDesc("infermesh_placement_generation",
		"The placement table's generation: it counts real changes.", nil, nil)
	descAdverts = prometheus.NewDesc("infermesh_adverts",
		"Received infer.<role> adverts held in the placement table, by role and freshness (fresh, stale).",
		[]string{"role", "state"}, nil)
	descLocal = prometheus.NewDesc("infermesh_local_instances",
		"Roles served by a local instance right now (1 per role).", []string{"role"}, nil)
	descExposed = prometheus.NewDesc("infermesh_exposed_roles",
		"Roles exposed to the mesh (1 per role).", []string{"role"}, nil)
	descPeers = prometheus.NewDesc("infermesh_peers",
		"Mesh members other than this node, by state.", []string{"state"}, nil)
	descCertExpiry = prometheus.NewDesc("infermesh_certificate_expiry_timestamp_seconds",
		"When this node's admission certificate expires (Unix time); absent without one.", nil, nil)
	descMeshRefusals = prometheus.NewDesc("infermesh_mesh_refusals_total",
		"Gossip messages and nodes the mesh refused, by reason.", []string{"reason"}, nil)
	descPeerCertExpiry = prometheus.NewDesc("infermesh_peer_certificate_expiry_timestamp_seconds",
		"When each live peer's admission certificate expires (Unix time), by node; "+
			"peers admitted by static trust have none.", []string{"node"}, nil)
)

func (c *scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGeneration, descAdverts, descLocal, descExposed, descPeers, descMeshRefusals, descCertExpiry, descPeerCertExpiry} {
		ch <- d
	}
}

func (c *scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	if c.placement != nil {
		s := c.placement.Snapshot()
		ch <- prometheus.MustNewConstMetric(descGeneration, prometheus.GaugeValue, float64(s.Generation))
		type rs struct{ fresh, stale int }
		counts := map[string]*rs{}
		for _, r := range s.Remotes {
			x := counts[r.Role]
			if x == nil {
				x = &rs{}
				counts[r.Role] = x
			}
			if r.Fresh {
				x.fresh++
			} else {
				x.stale++
			}
		}
		for role, x := range counts {
			ch <- prometheus.MustNewConstMetric(descAdverts, prometheus.GaugeValue, float64(x.fresh), role, "fresh")
			ch <- prometheus.MustNewConstMetric(descAdverts, prometheus.GaugeValue, float64(x.stale), role, "stale")
		}
		for role := range s.Locals {
			ch <- prometheus.MustNewConstMetric(descLocal, prometheus.GaugeValue, 1, role)
		}
		for _, role := range s.Exposed {
			ch <- prometheus.MustNewConstMetric(descExposed, prometheus.GaugeValue, 1, role)
		}
	}
	if h := c.m.mesh.Load(); h != nil {
		for state, n := range h.src.PeerStates() {
			ch <- prometheus.MustNewConstMetric(descPeers, prometheus.GaugeValue, float64(n), state)
		}
		for reason, n := range h.src.Refusals() {
			ch <- prometheus.MustNewConstMetric(descMeshRefusals, prometheus.CounterValue, float64(n), reason)
		}
		if exp, ok := h.src.CertificateExpiry(); ok {
			ch <- prometheus.MustNewConstMetric(descCertExpiry, prometheus.GaugeValue, float64(exp.Unix()))
		}
		for node, t := range h.src.PeerCertExpiries() {
			ch <- prometheus.MustNewConstMetric(descPeerCertExpiry, prometheus.GaugeValue, float64(t.Unix()), node)
		}
	}
}

// SetCapacity records role's local instance capacity (placement.Capacity).
func (m *Metrics) SetCapacity(role string, c placement.Capacity) {
	m.capacity.WithLabelValues(role, "slots").Set(float64(c.Slots))
	m.capacity.WithLabelValues(role, "running").Set(float64(c.Running))
	m.capacity.WithLabelValues(role, "waiting").Set(float64(c.Waiting))
	m.kvUsage.WithLabelValues(role).Set(float64(c.KVUsage))
}

// ForgetCapacity drops role's capacity (no local instance any more).
func (m *Metrics) ForgetCapacity(role string) {
	m.capacity.DeletePartialMatch(prometheus.Labels{"role": role})
	m.kvUsage.DeleteLabelValues(role)
}
