// Package agent wires infermeshd together: configuration, the placement
// table, the loopback proxy, the mesh, provisioning, the admin socket and the
// state store, and owns their lifecycle.
package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
)

// Version is the agent's version, set at build time with -ldflags.
var Version = "dev"

// Options are the run-time choices of the daemon that are not configuration.
type Options struct {
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
	// Dev runs the built-in demo model in-process as the upstream of every
	// role that has neither upstream nor instance.
	Dev bool
	// DemoTokenDelay paces the demo model's streamed tokens.
	DemoTokenDelay time.Duration
	// Notify receives readiness and status lines (sd_notify). Nil: none.
	Notify func(state string)
}

// Agent is one running infermeshd.
type Agent struct {
	cfg   *Config
	opts  Options
	log   *zap.Logger
	audit *Auditor
	table *placement.Table
	proxy *proxy.Proxy

	started time.Time

	mu    sync.Mutex
	addrs map[string]net.Addr // role -> bound proxy address
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
	a := &Agent{cfg: cfg, opts: opts, log: opts.Logger, addrs: map[string]net.Addr{}}
	a.audit = NewAuditor(a.log)
	table, err := placement.New(placement.Config{
		NodeID:    cfg.Node.Name,
		Audit:     a.audit,
		AdvertTTL: cfg.Mesh.AdvertTTL,
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.table = table
	p, err := proxy.New(proxy.Config{
		Resolver:        table,
		Peers:           table,
		MaxBodyBytes:    cfg.Proxy.MaxBodyBytes,
		ConnectTimeout:  cfg.Proxy.ConnectTimeout,
		UpstreamTimeout: cfg.Proxy.UpstreamTimeout,
		Logger:          a.log.Named("proxy"),
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.proxy = p
	return a, nil
}

// Table returns the agent's placement table.
func (a *Agent) Table() *placement.Table { return a.table }

// Audit returns the agent's audit log.
func (a *Agent) Audit() *Auditor { return a.audit }

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
// shutdown timeout) and stops. Cancellation is a clean stop: Run returns nil.
func (a *Agent) Run(ctx context.Context) error {
	a.started = time.Now()
	if err := os.MkdirAll(a.cfg.Node.StateDir, 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()

	upstreams := map[string]string{}
	for name, r := range a.cfg.Roles {
		upstreams[name] = r.Upstream
	}
	if a.opts.Dev {
		base, stop, err := a.startDemo()
		if err != nil {
			return err
		}
		defer stop()
		for name, r := range a.cfg.Roles {
			if r.Upstream == "" && r.Instance == nil {
				upstreams[name] = base
			}
		}
	}

	a.applyPolicy()

	roles := make([]string, 0, len(a.cfg.Roles))
	for name := range a.cfg.Roles {
		roles = append(roles, name)
	}
	sort.Strings(roles)
	for _, name := range roles {
		r := a.cfg.Roles[name]
		addr, err := a.proxy.Listen(name, net.JoinHostPort("127.0.0.1", strconv.Itoa(r.Port)))
		if err != nil {
			_ = a.proxy.Shutdown(context.Background())
			return fmt.Errorf("roles.%s.port: %w", name, err)
		}
		a.mu.Lock()
		a.addrs[name] = addr
		a.mu.Unlock()
		port := uint16(addr.(*net.TCPAddr).Port)
		a.table.SetProxyPort(name, port)
		a.log.Info("role listening", zap.String("role", name), zap.String("addr", addr.String()))
	}

	probeClient := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 2, DisableCompression: true}}
	defer probeClient.CloseIdleConnections()
	for _, name := range roles {
		base := upstreams[name]
		if base == "" {
			continue
		}
		pr := &upstreamProber{
			role:     name,
			local:    placement.Local{Base: base, Model: a.cfg.Roles[name].Model, API: "openai", Runtime: "static"},
			reg:      a.table,
			client:   probeClient,
			interval: a.cfg.Proxy.HealthInterval,
			log:      a.log,
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pr.run(runCtx)
		}()
	}

	a.notify("READY=1")
	a.notify(fmt.Sprintf("STATUS=serving %d role(s)", len(roles)))
	a.log.Info("infermeshd ready", zap.String("node", a.cfg.Node.Name), zap.String("version", Version))

	<-ctx.Done()
	a.notify("STOPPING=1")
	a.log.Info("stopping: draining in-flight requests", zap.Duration("timeout", a.cfg.Proxy.ShutdownTimeout))
	cancel()
	sctx, scancel := context.WithTimeout(context.Background(), a.cfg.Proxy.ShutdownTimeout)
	defer scancel()
	if err := a.proxy.Shutdown(sctx); err != nil {
		a.log.Warn("drain incomplete; cut remaining requests", zap.Error(err))
	}
	return nil
}

// applyPolicy loads the configured allowlists and exposure into placement.
func (a *Agent) applyPolicy() {
	for name, r := range a.cfg.Roles {
		a.table.ExposeToMesh(name, r.Expose)
		for _, n := range r.ServeTo {
			a.table.AllowMeshPeer(name, n, true)
		}
		for _, n := range r.AcceptFrom {
			a.table.AllowRemoteNode(name, n, true)
		}
	}
}

// startDemo serves the built-in demo model on an ephemeral loopback port.
func (a *Agent) startDemo() (base string, stop func(), err error) {
	model := "demo"
	for _, r := range a.cfg.Roles {
		if r.Model != "" {
			model = r.Model
			break
		}
	}
	dcfg := demomodel.DefaultConfig()
	dcfg.Model = model
	dcfg.TokenDelay = a.opts.DemoTokenDelay
	dcfg.Logger = a.log.Named("demo")
	srv, err := demomodel.New(dcfg)
	if err != nil {
		return "", nil, fmt.Errorf("demo model: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, fmt.Errorf("demo model: %w", err)
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = hs.Serve(ln)
	}()
	base = "http://" + ln.Addr().String()
	a.log.Info("demo model serving", zap.String("addr", base), zap.String("model", model))
	return base, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if hs.Shutdown(ctx) != nil {
			_ = hs.Close()
		}
		<-done
	}, nil
}
