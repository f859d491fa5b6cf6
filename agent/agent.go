package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/proxy"
	"github.com/infermesh/infermesh/telemetry"
)

// Version is the agent's version, set at build time with -ldflags.
var Version = "dev"

// Options are the run-time choices of the daemon that are not configuration.
type Options struct {
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
	// DevModel, when set, is dev mode: Run starts it and it serves every
	// role that has neither upstream nor instance. cmd/infermeshd passes the
	// built-in demo model, so the agent itself does not link it.
	DevModel DevModel
	// Simulated serves the roles whose instance is runtime simulated, one
	// server per role, named after the role's model (Validate makes it
	// SimulatedModel when the config names none).
	// cmd/infermeshd passes the built-in demo model, as for DevModel. Nil:
	// such a role fails Run, naming it.
	Simulated DevModel
	// Notify receives readiness and status lines (sd_notify). Nil: none.
	Notify func(state string)
	// Listen binds the role ports and the shared port (proxy.Config.Listen).
	// Nil: net.Listen.
	Listen func(network, addr string) (net.Listener, error)
	// OnAdminReady is called with the admin socket path once it answers.
	OnAdminReady func(socket string)
	// MeshTuning and ProvisionTuning adjust the mesh and instance manager
	// settings derived from the config (tests use short intervals). Nil:
	// the defaults.
	MeshTuning      func(*mesh.Config)
	ProvisionTuning func(*provision.ManagerConfig)
	// SweepTuning adjusts the orphan sweep's settings (tests use a short
	// grace period and interval). Nil: the defaults.
	SweepTuning func(*cleanup.SweeperConfig)
	// TransportTuning adjusts the QUIC transport's settings (tests use
	// short keep-alives and may hand it their own socket). Nil: defaults.
	TransportTuning func(*mesh.TransportConfig)
	// AdminTuning adjusts the admin runtime's options (tests inject fakes).
	AdminTuning func(*AdminOptions)
	// NodeTuning adjusts node bootstrap (tests: timeouts, binaries).
	NodeTuning func(*NodeOptions)
	// ResetState starts over with a state store Run would refuse (damaged,
	// gone while its policy mirror is there, disagreeing with the mirror):
	// the damaged files are kept aside, the run-time overrides restored
	// from the mirror when it verifies. infermeshd -reset-state.
	ResetState bool
	// NewIdentity lets Run make a new node key where one is missing on a
	// node that ran before (its state store is there); without it, Run
	// refuses. infermeshd -new-identity.
	NewIdentity bool
}

// DevModel starts an in-process model server for dev mode, serving model
// on loopback. It returns the server's base URL and stop, which shuts it
// down and waits for it.
type DevModel func(model string) (base string, stop func(), err error)

// Agent is one running infermeshd.
type Agent struct {
	// ready holds the role ports' Accept until Run reports READY.
	ready *acceptGate
	// cfg is the current config: the one the agent started with, then
	// what each reload put in force (Backend.Reload stores it). Every
	// part reads it where it uses a field, so a field a reload changes
	// is never read at its boot value; a field that needs a restart
	// keeps its boot value in it until then.
	cfg       atomic.Pointer[Config]
	opts      Options
	log       *zap.Logger
	audit     *Auditor
	table     *placement.Table
	proxy     *proxy.Proxy
	metrics   *metrics.Metrics
	admission mesh.AdmissionProxy
	scorer    *proxy.PeerScorer // nil without a mesh
	remote    lateRemote        // the proxy's Remote: the QUIC transport once Run started it
	binder    *portBinder       // binds the proxy's ports (Options.Listen behind the accept gate)
	instMu    sync.Mutex        // serializes applyInstances

	adminRefusals auditLimiter // rate-limits the audit of refused admin requests

	started time.Time
	infos   infoCache  // peers' info answers, for the mesh view (backend_mesh.go)
	recent  recentRing // the last requests the proxy finished (recent.go)
	// external is, per role, the requests at the local instance that did
	// not come through this agent, as its engine last counted them
	// (capacity.go): role -> *atomic.Int64.
	external sync.Map
	tracing  *telemetry.Tracing // nil unless telemetry.otlp_endpoint; Run shuts it down

	mu        sync.Mutex
	addrs     map[string]net.Addr // role -> bound proxy address
	mesh      *mesh.Mesh
	transport *mesh.Transport
	admin     *Admin
	prov      *provisioning
	nodes     *nodes       // nil without a mesh
	serving   *roleServing // set once Run built every part: reloads wait for it
}

// New validates the configuration and builds an agent; nothing is bound
// until Run.
func New(cfg *Config, opts Options) (*Agent, error) {
	if cfg == nil {
		return nil, errors.New("agent: nil config")
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	a := &Agent{opts: opts, log: opts.Logger, addrs: map[string]net.Addr{}, ready: newAcceptGate()}
	a.cfg.Store(cfg)
	a.binder = newPortBinder(a.ready.listen(opts.Listen))
	a.audit = NewAuditor(a.log)
	pcfg := placement.Config{
		NodeID:    cfg.Node.Name,
		Audit:     a.audit,
		AdvertTTL: cfg.Mesh.AdvertTTL,
	}
	if cfg.Mesh.Enabled() {
		pcfg.Admission = &a.admission
	}
	table, err := placement.New(pcfg)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.table = table
	mcfg := metrics.DefaultConfig()
	mcfg.Version = Version
	mcfg.Placement = table
	mcfg.RouteQueues = func() map[string]int { return a.proxy.QueueLens() }
	if a.metrics, err = metrics.New(mcfg); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	var tracer proxy.Tracer // nil interface when off: the proxy asks nothing
	if t := cfg.Telemetry; t.OTLPEndpoint != "" {
		tr, err := telemetry.New(telemetry.Config{Endpoint: t.OTLPEndpoint, Sample: t.Sample, Node: cfg.Node.Name, Version: Version})
		if err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
		a.tracing, tracer = tr, tr
	}
	resolver, remote, err := a.newScorer()
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	var accessLog *zap.Logger
	if cfg.Proxy.AccessLogOn() {
		accessLog = a.log.Named("access")
	}
	p, err := proxy.New(proxy.Config{
		Resolver:        resolver,
		Peers:           table,
		Remote:          remote,
		MaxBodyBytes:    cfg.Proxy.MaxBodyBytes,
		ConnectTimeout:  cfg.Proxy.ConnectTimeout,
		UpstreamTimeout: cfg.Proxy.UpstreamTimeout,
		MaxBodyMemory:   cfg.Proxy.MaxBodyMemory,
		MaxConns:        cfg.Proxy.MaxConns,
		BodyTimeout:     cfg.Proxy.BodyTimeout,
		WriteTimeout:    cfg.Proxy.WriteTimeout,
		Server:          cfg.Proxy.Server,
		Observer:        observers{Observer: a.metrics, recent: &a.recent},
		Tracer:          tracer,
		LoadReport: func(role string) proxy.LoadReport {
			return a.loadReport(role)
		},
		ExternalLoad: a.externalLoad,
		OnLoadReport: func(role, node string, r proxy.LoadReport) uint64 {
			return a.table.ReportLoad(role, node, r.Load, r.Capacity)
		},
		Routing: func(role string) proxy.RouteConfig { return a.config().Roles[role].Routing.routeConfig() },
		RTT: func(node string) time.Duration {
			if m := a.Mesh(); m != nil {
				return m.RTT(node)
			}
			return 0
		},
		PeerState: func(node, role string) proxy.PeerState {
			if a.scorer == nil {
				return proxy.PeerState{}
			}
			return a.scorer.State(node, role)
		},
		PinnedModel:   func(role string) string { return a.config().Roles[role].Model },
		UpstreamKey:   a.upstreamKey,
		NodeName:      cfg.Node.Name,
		AccessLog:     accessLog,
		AccessLogSkip: cfg.Proxy.AccessLogSkip(),
		Listen:        a.binder.listen,
		Logger:        a.log.Named("proxy"),
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.proxy = p
	return a, nil
}

// config is the current config.
func (a *Agent) config() *Config { return a.cfg.Load() }

// upstreamKey is the API key role's local instance requires, from the
// current config: the proxy, the probes and the instance manager send it.
func (a *Agent) upstreamKey(role string) string { return a.config().Roles[role].upstreamKey }

// Table returns the agent's placement table.
func (a *Agent) Table() *placement.Table { return a.table }

// Mesh returns the agent's mesh membership, nil without a mesh or before
// Run started it.
func (a *Agent) Mesh() *mesh.Mesh {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mesh
}

// AdminSocket returns the admin socket path once Run opened it.
func (a *Agent) AdminSocket() (string, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.admin == nil {
		return "", false
	}
	return a.admin.SocketPath(), true
}

// Reload re-reads the config file and applies what can change at run time
// (SIGHUP). It reports what changed.
func (a *Agent) Reload(ctx context.Context) (admin.ReloadResult, error) {
	a.mu.Lock()
	ad, serving := a.admin, a.serving != nil
	a.mu.Unlock()
	if ad == nil {
		return admin.ReloadResult{}, errors.New("agent is not running")
	}
	if !serving {
		return admin.ReloadResult{}, errors.New("the agent is still starting; reload once it is ready")
	}
	return ad.Backend().Reload(ctx, admin.Caller{UID: uint32(os.Getuid()), PID: int32(os.Getpid())})
}

// Audit returns the agent's audit log.
func (a *Agent) Audit() *Auditor { return a.audit }

// roleNames lists the configured roles, sorted.
func (a *Agent) roleNames() []string { return sortedKeys(a.config().Roles) }

// SharedAddr returns the bound address of proxy.listen.
func (a *Agent) SharedAddr() (net.Addr, bool) { return a.proxy.SharedAddr() }

// RoleAddr returns the bound loopback address of a role's port.
func (a *Agent) RoleAddr(role string) (net.Addr, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ad, ok := a.addrs[role]
	return ad, ok
}

func (a *Agent) notify(state string) {
	if a.opts.Notify != nil {
		a.opts.Notify(state)
	}
}

// Run starts every part, reports readiness, and serves until ctx is
// cancelled; then it drains in-flight requests (up to the configured
// shutdown timeout), leaves the mesh and stops. Cancellation is a clean
// stop: Run returns nil. Managed containers keep running across a stop and
// are adopted by the next start.
func (a *Agent) Run(ctx context.Context) error {
	a.started = time.Now()
	// Runs last: the spans of the requests drained on the way out are
	// exported too.
	defer a.stopTracing()
	if err := os.MkdirAll(a.config().Node.StateDir, 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	// Every goroutine Run starts is in wg and ends with runCtx: on any
	// return, cancel runs first (defers run last-in first-out), then the
	// wait, so a failure late in start-up stops what already started.
	var wg sync.WaitGroup
	defer wg.Wait()
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()

	if err := a.checkIdentity(); err != nil {
		return err
	}
	// What infermeshd --validate refuses, Run refuses: a certificate no peer
	// of this trust would admit is a config error, not a silent start
	// unadmitted. The checks it could not make are logged; an expiry, the
	// mesh logs itself.
	_, notes, err := a.config().checkCertificate()
	if err != nil {
		return err
	}
	for _, n := range notes {
		a.log.Warn(n)
	}
	// The mesh first: it owns the node key, and the admin backend reports
	// on it. Nothing is admitted until it is set into the table's
	// admission.
	m, err := a.startMesh(runCtx)
	if err != nil {
		return err
	}
	if m != nil {
		a.mu.Lock()
		a.mesh = m
		a.mu.Unlock()
		defer a.closeMesh(m)
		tr, err := a.startTransport(m)
		if err != nil {
			return fmt.Errorf("mesh.quic: %w", err)
		}
		defer tr.Close()
		// The transport outlives the signal: streams peers forwarded to us
		// drain like our own clients' (shutdownTransport below, after the
		// proxy's drain). Its context ends only when Run returns.
		trCtx, trCancel := context.WithCancel(context.WithoutCancel(runCtx))
		defer trCancel()
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.serveTransport(trCtx, tr)
		}()
	}

	// The admin socket claims its path (refusing to start when a live agent
	// answers there), opens the state store and applies the config's policy
	// with the stored run-time overrides on top.
	var insts lateInstances
	aopts := AdminOptions{Metrics: a.metrics, parts: a.reloadParts()}
	if len(a.config().desiredInstances()) > 0 {
		aopts.Instances = &insts
	}
	if m != nil {
		aopts.Mesh = m
	}
	if a.opts.AdminTuning != nil {
		a.opts.AdminTuning(&aopts)
	}
	ad, err := a.OpenAdmin(aopts)
	if err != nil {
		return err
	}
	defer func() {
		if err := ad.Close(); err != nil {
			a.log.Warn("closing the admin socket", zap.Error(err))
		}
	}()
	a.mu.Lock()
	a.admin = ad
	a.mu.Unlock()
	if m != nil {
		// Signed revocations the mesh accepts, from anyone, are kept in
		// the state store from now on (those before are delivered first).
		m.SetRevocationSink(ad.Backend())
		defer m.SetRevocationSink(nil) // before the store closes
	}
	// The audit history survives restarts; saved before the store closes.
	defer a.persistAudit(ad.Store())()
	a.warnUnservableRoles(ad.Backend())

	// Every role's port and local upstream: a static upstream, a simulated
	// instance (the built-in demo model, one server per role) and, in dev
	// mode, the demo model for every role with neither, each probed and
	// registered. A reload adds, moves and removes them (roleServing).
	devBase := ""
	if a.opts.DevModel != nil {
		base, stop, err := a.startDevModel()
		if err != nil {
			return err
		}
		defer stop()
		devBase = base
	}
	rs := a.newRoleServing(runCtx, devBase)
	defer rs.close()
	cfg := a.config()
	for _, name := range sortedKeys(cfg.Roles) {
		if err := rs.start(name, cfg.Roles[name]); err != nil {
			_ = a.proxy.Shutdown(context.Background())
			return err
		}
	}
	if l := cfg.Proxy.Listen; l != "" {
		addr, err := a.proxy.ListenShared(l, a.roleNames)
		if err != nil {
			_ = a.proxy.Shutdown(context.Background())
			return fmt.Errorf("proxy.listen: %w", err)
		}
		a.log.Info("shared port listening: every role, routed by model", zap.String("addr", addr.String()))
	}

	wg.Add(2)
	go func() {
		defer wg.Done()
		a.upkeepPlacement(runCtx)
	}()
	go func() {
		defer wg.Done()
		a.watchCapacity(runCtx)
	}()

	prov, err := a.startProvisioning(runCtx, ad.Store())
	if err != nil {
		// Other roles keep serving; the operator sees why instances do not.
		a.log.Error("provisioning disabled", zap.Error(err))
		a.audit.Record(Event{Kind: "provision.disabled", Fields: map[string]string{"why": err.Error()}})
	}
	if prov != nil {
		insts.m.Store(prov.mgr)
		a.mu.Lock()
		a.prov = prov
		a.mu.Unlock()
		defer prov.close()
		mgrDone := make(chan struct{})
		// Runs before prov.close: the instances configured to stop with
		// the agent are stopped once their supervisors have ended.
		defer a.stopWithAgent(prov.mgr, mgrDone)
		wg.Add(2)
		go func() {
			defer wg.Done()
			defer close(mgrDone)
			if err := prov.mgr.Run(runCtx); err != nil {
				a.log.Error("instance manager stopped", zap.Error(err))
			}
		}()
		go func() {
			defer wg.Done()
			prov.sweeper.Run(runCtx)
		}()
	}

	if m != nil {
		// Node bootstrap (`infermesh node add`): it needs the mesh, where
		// new nodes join. Its close runs before the admin runtime's, so
		// adds in flight tear down while the state store is open.
		nrt, err := a.startNodes(ad.Store(), m)
		if err != nil {
			a.log.Error("node bootstrap disabled", zap.Error(err))
			a.audit.Record(Event{Kind: "node.disabled", Fields: map[string]string{"why": err.Error()}})
		} else {
			a.mu.Lock()
			a.nodes = nrt
			a.mu.Unlock()
			defer nrt.close()
			wg.Add(1)
			go func() {
				defer wg.Done()
				nrt.recover(runCtx, a.log.Named("nodes"), ad.Backend())
			}()
		}
	}

	// Every part is built: a reload may change them from now on.
	a.mu.Lock()
	a.serving = rs
	a.mu.Unlock()
	if err := ad.Serve(runCtx); err != nil {
		_ = a.proxy.Shutdown(context.Background())
		return err
	}
	if a.opts.OnAdminReady != nil {
		a.opts.OnAdminReady(ad.SocketPath())
	}
	if m != nil {
		joined := newJoinWatch()
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.healMesh(runCtx, m, ad.Store(), joined)
		}()
		a.notify("STATUS=joining the mesh")
		a.awaitFirstJoin(ctx, joined.done)
	}

	a.ready.Open()
	a.notify("READY=1")
	a.notify(fmt.Sprintf("STATUS=serving %d role(s)", len(a.config().Roles)))
	a.log.Info("infermeshd ready", zap.String("node", a.config().Node.Name), zap.String("version", Version))

	<-ctx.Done()
	a.notify("STOPPING=1")
	if m != nil {
		// Leave first: peers forget our adverts at once and stop sending new
		// requests, while the ones in flight finish below.
		a.leaveMesh(m)
	}
	a.log.Info("stopping: draining in-flight requests", zap.Duration("timeout", a.config().Proxy.ShutdownTimeout))
	sctx, scancel := context.WithTimeout(context.Background(), a.config().Proxy.ShutdownTimeout)
	defer scancel()
	if err := a.proxy.Shutdown(sctx); err != nil {
		a.log.Warn("drain incomplete; cut remaining requests", zap.Error(err))
	}
	a.shutdownTransport(sctx)
	cancel()
	return nil
}

// stopTracing exports the spans left, within 5s, and stops tracing.
func (a *Agent) stopTracing() {
	if a.tracing == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.tracing.Shutdown(ctx); err != nil {
		a.log.Warn("traces not all exported", zap.Error(err))
	}
}

// warnUnservableRoles logs the roles nothing can ever serve, with the
// run-time overrides (an `infermesh allow`, a node add) in force. In dev
// mode the demo model serves them.
func (a *Agent) warnUnservableRoles(b *Backend) {
	if a.opts.DevModel != nil {
		return
	}
	p, err := b.policy()
	if err != nil {
		a.log.Warn("reading the run-time policy", zap.Error(err))
		return
	}
	for _, w := range a.config().unservableRoles(p.accept, true) {
		a.log.Warn(w)
	}
}

// startDevModel starts the dev model, named after the first role (in name
// order) that names a model, else "demo".
func (a *Agent) startDevModel() (base string, stop func(), err error) {
	model := "demo"
	for _, name := range sortedKeys(a.config().Roles) {
		if m := a.config().Roles[name].Model; m != "" {
			model = m
			break
		}
	}
	base, stop, err = a.opts.DevModel(model)
	if err != nil {
		return "", nil, fmt.Errorf("dev model: %w", err)
	}
	a.log.Info("dev model serving", zap.String("addr", base), zap.String("model", model))
	return base, stop, nil
}
