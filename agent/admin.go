package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/console"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/store"
)

// Admin is the agent's admin runtime: the state store, the backend, the
// admin socket and the optional metrics port. Create it with OpenAdmin in
// Run before anything else is bound, Serve it once the agent is up, Close
// it on the way out.
type Admin struct {
	a       *Agent
	store   *store.Store
	backend *Backend
	metrics *metrics.Metrics
	ln      *net.UnixListener
	srv     *admin.Server
	log     *zap.Logger

	mu        sync.Mutex
	serving   bool
	metricsHS *http.Server
	metricsLn net.Listener
	// console is the web console (admin.console), consoleToken its token
	// file; nil and "" when off.
	console      *console.Server
	consoleToken string
	cancel       context.CancelFunc
	wg           sync.WaitGroup
	closeOnce    sync.Once
	closeErr     error
}

// OpenAdmin claims the admin socket (an agent already answering on it makes
// this fail with an error wrapping admin.ErrInUse; a stale socket file is
// removed), opens the state store in the state dir, and applies the
// config's policy with the stored overrides on top. Nothing is answered
// until Serve, but clients may already connect: they wait.
func (a *Agent) OpenAdmin(opts AdminOptions) (*Admin, error) {
	lc := admin.ListenConfig{Path: a.config().Admin.Socket, Group: a.config().Admin.Group}
	if a.config().Admin.PublicRead {
		lc.SocketMode, lc.DirMode = 0o666, 0o755
	}
	ln, err := admin.Listen(lc)
	if err != nil {
		return nil, err
	}
	st, err := a.openStore(opts.StoreLockTimeout)
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	b, err := NewBackend(a, st, opts)
	if err != nil {
		_ = st.Close()
		_ = ln.Close()
		return nil, err
	}
	ad := &Admin{a: a, store: st, backend: b, metrics: opts.Metrics, ln: ln, log: a.log.Named("admin")}
	scfg := admin.Config{
		Backend: b,
		Group:   a.config().Admin.Group,
		Logger:  ad.log,
		OnRefused: func(c admin.Caller, method, path, why string) {
			// Counted always; audited once per caller and reason per
			// interval, so a read-only user cannot flood the history.
			if opts.Metrics != nil {
				opts.Metrics.Refused("admin_forbidden")
			}
			if !a.adminRefusals.allow(c.String()+"\x00"+why, time.Now()) {
				return
			}
			a.audit.Record(Event{Kind: AuditAdminRefused, Fields: map[string]string{
				"why": why, "request": method + " " + path, "caller": c.String(),
			}})
		},
	}
	if opts.Metrics != nil {
		scfg.Metrics = opts.Metrics.Handler()
		if opts.Mesh != nil {
			opts.Metrics.SetMesh(meshStats{m: opts.Mesh, tr: a.Transport})
		}
	}
	if ad.srv, err = admin.New(scfg); err != nil {
		_ = st.Close()
		_ = ln.Close()
		return nil, err
	}
	return ad, nil
}

// Backend is the admin backend (for SIGHUP: Backend().Reload).
func (ad *Admin) Backend() *Backend { return ad.backend }

// Store is the state store (its buckets: package store's registry).
func (ad *Admin) Store() *store.Store { return ad.store }

// SocketPath is the admin socket.
func (ad *Admin) SocketPath() string { return ad.ln.Addr().String() }

// Serve starts answering the socket, the metrics port (admin.metrics) when
// configured, and counting audited refusals in the metrics. Its goroutines
// end at Close or when ctx ends.
func (ad *Admin) Serve(ctx context.Context) error {
	ad.mu.Lock()
	defer ad.mu.Unlock()
	if ad.serving {
		return errors.New("admin: already serving")
	}
	ad.serving = true
	ctx, ad.cancel = context.WithCancel(ctx)
	if addr := ad.a.config().Admin.Metrics; addr != "" && ad.metrics != nil {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			ad.cancel()
			return fmt.Errorf("admin.metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", ad.metrics.Handler())
		// Liveness and readiness (every role has a candidate), for a
		// central monitor or a load balancer in front of the node.
		probes := ad.a.proxy.ProbeHandler(ad.a.roleNames, nil)
		mux.Handle("GET /health", probes)
		mux.Handle("GET /ready", probes)
		ad.metricsLn = ln
		ad.metricsHS = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		ad.wg.Add(1)
		go func() {
			defer ad.wg.Done()
			if err := ad.metricsHS.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				ad.log.Error("metrics listener stopped", zap.Error(err))
			}
		}()
		ad.log.Info("metrics listening", zap.String("addr", ln.Addr().String()))
	}
	if addr := ad.a.config().Admin.Console; addr != "" {
		if err := ad.startConsole(addr); err != nil {
			if hs := ad.metricsHS; hs != nil {
				_ = hs.Close()
			}
			ad.cancel()
			return err
		}
	}
	ad.wg.Add(1)
	go func() {
		defer ad.wg.Done()
		if err := ad.srv.Serve(ad.ln); err != nil {
			ad.log.Error("admin socket stopped", zap.Error(err))
		}
	}()
	if ad.metrics != nil {
		ch, unsub := ad.a.audit.Subscribe(1024)
		ad.wg.Add(1)
		go func() {
			defer ad.wg.Done()
			defer unsub()
			ad.countRefusals(ctx, ch)
		}()
	}
	ad.wg.Add(1)
	go func() {
		defer ad.wg.Done()
		<-ctx.Done()
		ad.stopServers()
	}()
	ad.log.Info("admin socket ready", zap.String("socket", ad.SocketPath()))
	return nil
}

// MetricsAddr is the bound metrics address, when serving one.
func (ad *Admin) MetricsAddr() (net.Addr, bool) {
	ad.mu.Lock()
	defer ad.mu.Unlock()
	if ad.metricsLn == nil {
		return nil, false
	}
	return ad.metricsLn.Addr(), true
}

func (ad *Admin) countRefusals(ctx context.Context, ch <-chan Event) {
	// Serve subscribes once, so the history replayed at subscription
	// (refusals during start-up) is counted once too.
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-ch:
			if !ok {
				return
			}
			if reason, ok := refusalReason(e); ok {
				ad.metrics.Refused(reason)
			}
		}
	}
}

// refusalReason is the metrics label of an audited refusal. The mesh's
// own refusals are left out: it counts them itself (every one, where its
// audit is rate-limited) and they are exported as
// infermesh_mesh_refusals_total. Admin refusals carry the caller in their
// why, so they get one fixed label.
func refusalReason(e Event) (string, bool) {
	switch {
	case !strings.HasSuffix(e.Kind, ".refused") || strings.HasPrefix(e.Kind, "mesh.") || e.Kind == AuditAdminRefused:
		// The mesh counts its own (Refusals); admin refusals are counted
		// as they happen, their audit being rate-limited.
		return "", false
	case e.Fields["why"] != "":
		return e.Fields["why"], true
	}
	return e.Kind, true
}

func (ad *Admin) stopServers() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = ad.srv.Shutdown(ctx)
	ad.mu.Lock()
	hs := ad.metricsHS
	ad.mu.Unlock()
	if hs != nil {
		_ = hs.Shutdown(ctx)
	}
	ad.stopConsole(ctx)
}

// Close stops the socket and the metrics port (ending event streams), waits
// for their goroutines and closes the store. It is idempotent.
func (ad *Admin) Close() error {
	ad.closeOnce.Do(func() {
		ad.mu.Lock()
		cancel := ad.cancel
		serving := ad.serving
		ad.mu.Unlock()
		if cancel != nil {
			cancel()
		}
		ad.stopServers()
		if !serving {
			_ = ad.ln.Close() // Serve never took it over
		}
		ad.wg.Wait()
		ad.closeErr = ad.store.Close()
	})
	return ad.closeErr
}

// meshStats adapts the mesh (and its QUIC transport, once running) to
// metrics.MeshSource.
type meshStats struct {
	m  MeshAPI
	tr func() *mesh.Transport
}

func (s meshStats) PeerStates() map[string]int {
	out := map[string]int{"admitted": 0, "not_admitted": 0}
	for _, p := range s.m.Members() {
		switch {
		case p.Self:
		case p.Admitted:
			out["admitted"]++
		default:
			out["not_admitted"]++
		}
	}
	return out
}

// Refusals merges the gossip refusals with the QUIC transport's (handshakes
// and requests refused), the latter as quic_<reason>.
func (s meshStats) Refusals() map[string]uint64 {
	out := s.m.Refusals()
	if s.tr == nil {
		return out
	}
	if tr := s.tr(); tr != nil {
		for why, n := range tr.Refusals() {
			out["quic_"+why] += n
		}
	}
	return out
}

// CertificateExpiry is this node's admission certificate's expiry.
func (s meshStats) CertificateExpiry() (time.Time, bool) { return s.m.CertificateExpiry() }

// auditLimiter lets one audit through per key per auditEvery: refusals
// are counted always, audited at this rate.
type auditLimiter struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// auditEvery is how often one repeated refusal (same key) is audited.
const auditEvery = 10 * time.Second

func (l *auditLimiter) allow(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last = map[string]time.Time{}
	}
	if t, ok := l.last[key]; ok && now.Sub(t) < auditEvery {
		return false
	}
	if len(l.last) >= 4096 {
		for k, t := range l.last {
			if now.Sub(t) >= auditEvery {
				delete(l.last, k)
			}
		}
	}
	l.last[key] = now
	return true
}

// PeerCertExpiries is when each live peer's admission certificate expires.
func (s meshStats) PeerCertExpiries() map[string]time.Time {
	out := map[string]time.Time{}
	for _, p := range s.m.Members() {
		if !p.Self && !p.CertExpires.IsZero() {
			out[p.Name] = p.CertExpires
		}
	}
	return out
}
