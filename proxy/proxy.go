package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/clients"
	"github.com/infermesh/infermesh/placement"
)

// Resolver yields the ordered candidates serving a role. placement.Table
// satisfies it. Resolve is called once per request and must be safe for
// concurrent use and must not block.
type Resolver interface {
	Resolve(role string) []placement.Candidate
}

// PeerResolver finds the local instance a peer's forwarded request may reach.
// placement.Table satisfies it. Safe for concurrent use, non-blocking.
type PeerResolver interface {
	LocalForPeer(role, peer string) (placement.Local, bool)
}

// UnorderedResolver is a Resolver that also yields the candidates
// unordered (the local instance first): the proxy asks for them so when
// it orders them itself (routing policy auto). placement.Table satisfies
// it.
type UnorderedResolver interface {
	Resolver
	Candidates(role string) []placement.Candidate
}

var (
	_ UnorderedResolver = (*placement.Table)(nil)
	_ UnorderedResolver = (*PeerScorer)(nil)
	_ Resolver          = (*placement.Table)(nil)
	_ PeerResolver      = (*placement.Table)(nil)
)

// Observer is told about every forwarded request, for metrics. Methods are
// called on the request path, concurrently, and must not block.
type Observer interface {
	// Attempt reports one forwarding attempt to a candidate: its target
	// ("local" or the peer node id), the HTTP status (0 when no response was
	// received), and the time to the response headers.
	Attempt(role, target string, status int, err error, ttfb time.Duration)
	// Done reports a finished request.
	Done(o Outcome)
	// StreamOpen and StreamClose bracket a streaming (SSE) response.
	StreamOpen(role string)
	StreamClose(role string)
}

// Outcome is one finished request as an Observer sees it.
type Outcome struct {
	Role string
	// Target answered it: "local", a peer node id, or "" when no
	// candidate saw the request (refused, or nothing serves the role).
	Target string
	// Source is who sent it: "app" (a role port or proxy.listen) or "peer"
	// (a peer agent over the mesh, served here).
	Source   string
	Status   int
	Duration time.Duration
	// FirstEvent is the time to the first SSE event relayed to the client
	// (the first token of a stream); 0 for a response that is not a stream
	// or a stream that ended before any event.
	FirstEvent time.Duration
	// Bytes is the response body bytes sent to the client.
	Bytes int64
	// Aborted says the response was cut after it started.
	Aborted bool
	// Usage says the instance reported token usage (a JSON body's or the
	// final SSE event's "usage"); then PromptTokens and CompletionTokens
	// are its counts.
	Usage                          bool
	PromptTokens, CompletionTokens int64
	// RequestID is the request's X-Request-Id (the app's, or the one the
	// proxy gave it).
	RequestID string
	// Attempts is how many candidates were sent the request (0: none was;
	// more than 1: it failed over).
	Attempts int
	// Route is how the candidate was chosen (route.go); nil when there
	// was nothing to choose (one candidate, or a peer's request).
	Route *RouteInfo

	// ticket is the client the request is charged to when it ends, and
	// bodyLen its body's size (the estimate of a prompt without usage).
	ticket  clients.Ticket
	bodyLen int
}

// Config configures a Proxy. Zero values mean the defaults.
type Config struct {
	// Resolver picks candidates for a role. Required.
	Resolver Resolver
	// Peers answers which local instance a peer may reach (mesh-side
	// serving). Nil refuses every peer request.
	Peers PeerResolver
	// Remote carries requests to peer agents; requests for a remote
	// candidate are sent to https://<node id><path>. Nil: remote candidates
	// are skipped (there is no mesh).
	Remote http.RoundTripper
	// MaxBodyBytes limits request bodies. Default 16 MiB.
	MaxBodyBytes int64
	// ConnectTimeout bounds dialing a local instance. Default 2s.
	ConnectTimeout time.Duration
	// UpstreamTimeout bounds the wait for an instance's response headers
	// (time to first token for streams). Default 5m.
	UpstreamTimeout time.Duration
	// MaxIdleConnsPerUpstream sizes the keep-alive pool to each instance.
	// Default 512.
	MaxIdleConnsPerUpstream int
	// MaxBodyMemory bounds the memory held by request bodies in flight,
	// all role ports together; a request that would go over it is refused
	// with 503 and Retry-After. Default 256 MiB.
	MaxBodyMemory int64
	// MaxConns bounds the client connections of all role ports together.
	// Near it, idle connections are closed early; at it, new connections
	// are answered 503 and closed. Default: half of what the open-file
	// limit leaves after a reserve of fdReserve descriptors (a proxied
	// request holds two), so the admin socket, the mesh and the instances
	// always have descriptors left.
	MaxConns int
	// Server selects the HTTP implementation of the role ports and of the
	// client of local instances: ServerInfermesh (default; h1Server and
	// upstreamClient, built for speed) or ServerStd (net/http's server and
	// http.Transport, the known-good fallback). Both keep the same bounds.
	Server string
	// HeaderTimeout bounds reading a request head once its first byte
	// arrived. Default 10s.
	HeaderTimeout time.Duration
	// BodyTimeout bounds reading a request body (and draining what a
	// handler left of one). Default 60s.
	BodyTimeout time.Duration
	// WriteTimeout bounds each write to a client, so a client that stops
	// reading (a stalled stream) frees its instance. Default 60s.
	WriteTimeout time.Duration
	// Observer receives per-request measurements. Nil: none.
	Observer Observer
	// Tracer traces requests across the hop (trace.go). Nil: off.
	Tracer Tracer
	// LoadReport gives the load report every answer to a peer for role
	// carries (loadreport.go). Nil: none is sent.
	LoadReport func(role string) LoadReport
	// ExternalLoad is the requests at role's local instance that did not
	// come through this proxy, as its engine last counted them: the local
	// candidate's load is that plus this proxy's own count now. Nil: none.
	ExternalLoad func(role string) int64
	// OnLoadReport takes the load report of node's answer for role,
	// before the answer is relayed, and returns the candidate's LoadSeq
	// it is held under (0: not taken). Must be quick. Nil: reports are
	// ignored.
	OnLoadReport func(role, node string, r LoadReport) uint64
	// Routing gives a role's routing settings (route.go), read on every
	// request with more than one candidate. Nil: the defaults (policy
	// auto, no queue).
	Routing func(role string) RouteConfig
	// RTT is the measured round trip to a peer node (0: unknown).
	RTT func(node string) time.Duration
	// PeerState says what this node remembers of node's recent answers
	// for role (PeerScorer.State). Nil: nothing.
	PeerState func(node, role string) PeerState
	// PinnedModel names the model role's own instance serves (the config's
	// roles.<r>.model), known even while no candidate is: a request for it
	// then gets 503 with Retry-After (the instance is coming back), not
	// 404. Nil or "": only the role name is known without candidates.
	PinnedModel func(role string) string
	// UpstreamKey returns the API key role's local instance requires ("" for
	// none). When set it is sent as Authorization: Bearer on every request
	// to that instance, an app's or a peer's, in place of the app's own
	// Authorization. It is read on each request, so a reload applies at once.
	UpstreamKey func(role string) string
	// Clients admits every app request as one of this host's clients,
	// under its limits (clients.go). Nil: no client is known and every
	// request is welcome.
	Clients *clients.Registry
	// NodeName is this node's name, sent in ServedByHeader. "": none.
	NodeName string
	// Listen binds the listener of a role port or of the shared port
	// (network "tcp"). Nil: net.Listen. cmd/infermeshd hands over sockets
	// that systemd kept open across a restart, so the port never closes.
	// A listener that is also a ConnHandover gets the idle connections
	// when the proxy shuts down (the default server only).
	Listen func(network, addr string) (net.Listener, error)
	// AccessLog receives one line per request (info). Nil: none.
	AccessLog *zap.Logger
	// AccessLogSkip is the fraction of successful requests left out of
	// the access log (errors and aborted streams are always in it).
	// Default 0: every request.
	AccessLogSkip float64
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
}

// DefaultConfig returns the defaults (without a Resolver).
func DefaultConfig() Config {
	return Config{
		MaxBodyBytes:            16 << 20,
		ConnectTimeout:          2 * time.Second,
		UpstreamTimeout:         5 * time.Minute,
		MaxIdleConnsPerUpstream: 512,
		MaxBodyMemory:           256 << 20,
		MaxConns:                defaultMaxConns(),
		BodyTimeout:             60 * time.Second,
		WriteTimeout:            60 * time.Second,
	}
}

func (c *Config) fill() error {
	if c.Resolver == nil {
		return errors.New("proxy config: Resolver is required")
	}
	d := DefaultConfig()
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("proxy config: MaxBodyBytes %d is negative", c.MaxBodyBytes)
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = d.MaxBodyBytes
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = d.ConnectTimeout
	}
	if c.UpstreamTimeout <= 0 {
		c.UpstreamTimeout = d.UpstreamTimeout
	}
	if c.MaxIdleConnsPerUpstream <= 0 {
		c.MaxIdleConnsPerUpstream = d.MaxIdleConnsPerUpstream
	}
	if c.MaxBodyMemory < 0 || c.MaxConns < 0 {
		return fmt.Errorf("proxy config: MaxBodyMemory %d and MaxConns %d must not be negative", c.MaxBodyMemory, c.MaxConns)
	}
	if c.MaxBodyMemory == 0 {
		c.MaxBodyMemory = d.MaxBodyMemory
	}
	if c.MaxBodyMemory < c.MaxBodyBytes {
		return fmt.Errorf("proxy config: MaxBodyMemory %d is below MaxBodyBytes %d", c.MaxBodyMemory, c.MaxBodyBytes)
	}
	if c.MaxConns == 0 {
		c.MaxConns = d.MaxConns
	}
	if c.BodyTimeout <= 0 {
		c.BodyTimeout = d.BodyTimeout
	}
	if c.HeaderTimeout <= 0 {
		c.HeaderTimeout = 10 * time.Second
	}
	switch c.Server {
	case "":
		c.Server = ServerInfermesh
	case ServerInfermesh, ServerStd:
	default:
		return fmt.Errorf("proxy config: Server %q is not %q or %q", c.Server, ServerInfermesh, ServerStd)
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = d.WriteTimeout
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.AccessLogSkip < 0 || c.AccessLogSkip > 1 {
		return fmt.Errorf("proxy config: AccessLogSkip %v is not within 0 and 1", c.AccessLogSkip)
	}
	return nil
}

// Proxy is the set of loopback role listeners plus the forwarding core they
// share.
type Proxy struct {
	cfg     Config
	up      *upstreamClient // plain-http local instances (the hot path)
	local   *http.Transport // local instances with other schemes
	log     *zap.Logger
	busy    busyCounts   // requests at the local instance, per role
	router  *router      // route.go
	bodyMem *memBudget   // request bodies in flight
	conns   *connLimiter // client connections of every role port
	// meterUsage: responses are metered for their token usage (for the
	// Observer, or for the clients' token limits).
	meterUsage bool

	mu      sync.Mutex
	servers map[string]*roleServer // by role
	closed  bool
}

type roleServer struct {
	role string
	ln   net.Listener
	srv  httpServer
	done chan struct{}
}

// New validates cfg and returns a Proxy with no listeners.
func New(cfg Config) (*Proxy, error) {
	explicitConns := cfg.MaxConns
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if budget, limit, ok := fdBudget(); ok && explicitConns > 0 && int64(explicitConns) > budget {
		// Past the budget, accept fails for want of descriptors (and the
		// mesh, the admin socket and the instances starve) before the
		// cap answers 503.
		cfg.Logger.Warn("proxy.max_conns is above what the open-file limit leaves for client connections; raise LimitNOFILE or lower max_conns",
			zap.Int("max_conns", explicitConns), zap.Int64("budget", budget), zap.Uint64("nofile_limit", limit), zap.Int("reserve", fdReserve))
	}
	dialer := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		Proxy:                  nil, // never send loopback traffic through an environment proxy
		DialContext:            dialer.DialContext,
		MaxIdleConns:           0,
		MaxIdleConnsPerHost:    cfg.MaxIdleConnsPerUpstream,
		IdleConnTimeout:        90 * time.Second,
		ResponseHeaderTimeout:  cfg.UpstreamTimeout,
		MaxResponseHeaderBytes: maxResponseHead,
		DisableCompression:     true,
		ForceAttemptHTTP2:      false,
		WriteBufferSize:        16 << 10,
		ReadBufferSize:         16 << 10,
	}
	up := newUpstreamClient(cfg.ConnectTimeout, cfg.UpstreamTimeout, cfg.MaxIdleConnsPerUpstream)
	return &Proxy{
		cfg: cfg, up: up, local: tr, log: cfg.Logger, servers: map[string]*roleServer{},
		bodyMem:    &memBudget{max: cfg.MaxBodyMemory},
		conns:      &connLimiter{max: int64(cfg.MaxConns)},
		router:     newRouter(),
		meterUsage: cfg.Observer != nil || cfg.Clients != nil,
	}, nil
}

// ConnHandover is implemented by a listener whose idle client connections
// can outlive the proxy: cmd/infermeshd's, under systemd, hands them to
// the file descriptor store, and the next agent serves them (nothing of
// them was read, so the next request on one is whole). HandOver is called
// from Shutdown, once per idle connection, concurrently; the caller
// closes its own descriptor after it returns. An error means the
// connection could not be handed over (the caller closes it as it would
// without a handover).
type ConnHandover interface {
	HandOver(c net.Conn) error
}

// ErrClosed is returned by Listen after Shutdown.
var ErrClosed = errors.New("proxy is shut down")

// Listen binds role's loopback listener on addr and starts serving it.
// Non-loopback addresses are refused: the proxy speaks plain HTTP to local
// apps only. It returns the bound address (useful with port 0).
func (p *Proxy) Listen(role, addr string) (net.Addr, error) {
	if err := placement.ValidateRole(role); err != nil {
		return nil, err
	}
	if !IsLoopbackAddr(addr) {
		return nil, fmt.Errorf("role %q: listen address %q is not a loopback address", role, addr)
	}
	only := []string{role}
	return p.listen(role, addr, p.ProbeHandler(func() []string { return only }, p.traced(role, sourceApp, p.RoleHandler(role))))
}

// listen binds addr and serves h on it, as the server of key (a role, or
// sharedKey).
func (p *Proxy) listen(key, addr string, h http.Handler) (net.Addr, error) {
	name := "role " + strconv.Quote(key)
	if key == sharedKey {
		name = "proxy.listen"
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if _, ok := p.servers[key]; ok {
		return nil, fmt.Errorf("%s: already listening", name)
	}
	listen := p.cfg.Listen
	if listen == nil {
		listen = net.Listen
	}
	ln, err := listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	rs := &roleServer{role: key, ln: ln, done: make(chan struct{})}
	hcfg := h1Config{
		ReadHeaderTimeout: p.cfg.HeaderTimeout,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		BodyTimeout:       p.cfg.BodyTimeout,
		WriteTimeout:      p.cfg.WriteTimeout,
		Conns:             p.conns,
		Logger:            p.log.Named("http"),
	}
	if p.cfg.Server == ServerStd {
		rs.srv = newStdServer(h, hcfg)
	} else {
		rs.srv = newH1Server(h, hcfg)
	}
	p.servers[key] = rs
	go func() {
		defer close(rs.done)
		if err := rs.srv.Serve(ln); err != nil && !errors.Is(err, errServerClosed) {
			p.log.Error("listener stopped", zap.String("listener", name), zap.Error(err))
		}
	}()
	return ln.Addr(), nil
}

// Addr returns the bound address of role's listener.
func (p *Proxy) Addr(role string) (net.Addr, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rs, ok := p.servers[role]
	if !ok {
		return nil, false
	}
	return rs.ln.Addr(), true
}

// Close stops role's listener at once (in-flight requests are cut).
func (p *Proxy) Close(role string) error {
	p.mu.Lock()
	rs, ok := p.servers[role]
	delete(p.servers, role)
	p.mu.Unlock()
	if !ok {
		return nil
	}
	err := rs.srv.Close()
	<-rs.done
	return err
}

// Retire takes role's listener out of the proxy, still serving, and
// returns its drain; ok is false when role has none. From then on Listen
// may bind the role again (on another address at once, on the same one
// once the drain began), and Shutdown no longer covers it: drain stops it
// as Shutdown does, for this listener alone. It accepts no more
// connections, lets the requests in flight (streams included) finish
// until ctx ends, then cuts what is left, and returns once its
// connections are closed.
func (p *Proxy) Retire(role string) (drain func(ctx context.Context) error, ok bool) {
	p.mu.Lock()
	rs, ok := p.servers[role]
	delete(p.servers, role)
	p.mu.Unlock()
	if !ok {
		return nil, false
	}
	return func(ctx context.Context) error {
		err := rs.srv.Shutdown(ctx)
		if err != nil {
			_ = rs.srv.Close()
		}
		<-rs.done
		return err
	}, true
}

// Shutdown stops accepting, waits for in-flight requests (streams included)
// until ctx ends, then cuts what is left. It is idempotent.
func (p *Proxy) Shutdown(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	servers := make([]*roleServer, 0, len(p.servers))
	for _, rs := range p.servers {
		servers = append(servers, rs)
	}
	p.servers = map[string]*roleServer{}
	p.mu.Unlock()

	var errs []error
	var wg sync.WaitGroup
	var emu sync.Mutex
	for _, rs := range servers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rs.srv.Shutdown(ctx); err != nil {
				_ = rs.srv.Close()
				emu.Lock()
				errs = append(errs, fmt.Errorf("role %q: %w", rs.role, err))
				emu.Unlock()
			}
			<-rs.done
		}()
	}
	wg.Wait()
	p.up.closeIdle(true)
	p.local.CloseIdleConnections()
	return errors.Join(errs...)
}
