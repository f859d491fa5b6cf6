package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
)

// roleServing runs what serves each role of the current config on this
// node, besides managed instances (the instance manager's): its port's
// listener, through the proxy, and its local upstream, probed and
// registered in placement (a static upstream, a simulated instance, or dev
// mode's model). Run starts the roles it starts with; a reload starts the
// roles it adds, moves a role to its new port, replaces an upstream, and
// retires the roles it removes: their listener drains (the requests in
// flight finish, up to proxy.shutdown_timeout), then their upstream stops
// and their managed instance is removed. Its goroutines end with close.
// Safe for concurrent use.
type roleServing struct {
	a       *Agent
	ctx     context.Context
	cancel  context.CancelFunc
	client  *http.Client // the probes'
	devBase string       // dev mode's model ("" outside dev mode)
	wg      sync.WaitGroup

	// change is held by each of start, update, retire and close, whole:
	// a role's servedRole is only written under it.
	change   sync.Mutex
	mu       sync.Mutex
	closed   bool
	roles    map[string]*servedRole
	retiring map[string]*retiringRole // removed, draining
}

// servedRole is one role being served here.
type servedRole struct {
	port int    // as configured (0 in tests: any)
	addr string // bound
	src  roleSource
	up   *runningSource // nil for a managed instance or none
}

// retiringRole is a removed role whose listener drains: its upstream (and
// managed instance) serve the requests in flight until the drain is over.
type retiringRole struct {
	up       *runningSource
	src      roleSource
	instance *provision.InstanceSpec // its managed instance's, kept meanwhile
}

// roleSource is where a role's requests go on this node.
type roleSource struct {
	kind  string // sourceStatic, sourceDev, sourceSimulated, sourceManaged, or "" for none
	base  string // static: the upstream
	model string
}

const (
	sourceStatic    = "static"
	sourceDev       = "dev"
	sourceSimulated = provision.RuntimeSimulated
	sourceManaged   = "managed"
)

// runningSource is a local upstream probed on a goroutine of its own (and
// a simulated instance's server): newSource prepares it, run starts the
// probe, stop ends both.
type runningSource struct {
	rs      *roleServing
	prober  *upstreamProber
	stopFn  func() // stops a simulated instance's server; nil otherwise
	started bool
	cancel  context.CancelFunc
	done    chan struct{}
}

func (s *runningSource) run() {
	if s == nil {
		return
	}
	ctx, cancel := context.WithCancel(s.rs.ctx)
	s.started, s.cancel, s.done = true, cancel, make(chan struct{})
	s.rs.wg.Add(1)
	go func() {
		defer s.rs.wg.Done()
		defer close(s.done)
		s.prober.run(ctx)
	}()
}

func (s *runningSource) stop() {
	if s == nil {
		return
	}
	if s.started {
		s.cancel()
		<-s.done
	}
	if s.stopFn != nil {
		s.stopFn()
	}
}

func (a *Agent) newRoleServing(ctx context.Context, devBase string) *roleServing {
	ctx, cancel := context.WithCancel(ctx)
	return &roleServing{
		a: a, ctx: ctx, cancel: cancel, devBase: devBase,
		client: &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 2, DisableCompression: true}},
		roles:  map[string]*servedRole{}, retiring: map[string]*retiringRole{},
	}
}

// sourceOf is where r's requests go here.
func (rs *roleServing) sourceOf(r RoleConfig) roleSource {
	switch {
	case r.Upstream != "":
		return roleSource{kind: sourceStatic, base: r.Upstream, model: r.Model}
	case r.Instance != nil && r.Instance.Runtime == provision.RuntimeSimulated:
		return roleSource{kind: sourceSimulated, model: cmp.Or(r.Model, SimulatedModel)}
	case r.Instance != nil:
		return roleSource{kind: sourceManaged}
	case rs.devBase != "":
		return roleSource{kind: sourceDev, base: rs.devBase, model: r.Model}
	}
	return roleSource{}
}

// start serves a role: its listener on r.Port, then its upstream. An error
// names the field and leaves nothing of the role running.
func (rs *roleServing) start(name string, r RoleConfig) error {
	rs.change.Lock()
	defer rs.change.Unlock()
	rs.mu.Lock()
	if rs.closed {
		rs.mu.Unlock()
		return errors.New("the agent is stopping")
	}
	old := rs.retiring[name]
	delete(rs.retiring, name)
	rs.mu.Unlock()
	if old != nil {
		// Removed and added again while its old listener drains: the new
		// role's upstream serves those requests too.
		old.up.stop()
		rs.deregister(name, old.src)
	}
	src := rs.sourceOf(r)
	up, err := rs.newSource(name, src)
	if err != nil {
		return err
	}
	sr := &servedRole{port: r.Port, src: src, up: up}
	if err := rs.listen(name, sr); err != nil {
		up.stop()
		return err
	}
	up.run()
	rs.mu.Lock()
	rs.roles[name] = sr
	rs.mu.Unlock()
	return nil
}

// listen binds sr's port for role name and serves it.
func (rs *roleServing) listen(name string, sr *servedRole) error {
	a := rs.a
	addr, err := a.proxy.Listen(name, net.JoinHostPort("127.0.0.1", strconv.Itoa(sr.port)))
	if err != nil {
		return fmt.Errorf("roles.%s.port: %w", name, err)
	}
	sr.addr = addr.String()
	a.mu.Lock()
	a.addrs[name] = addr
	a.mu.Unlock()
	a.table.SetProxyPort(name, uint16(addr.(*net.TCPAddr).Port))
	a.log.Info("role listening", zap.String("role", name), zap.String("addr", sr.addr))
	return nil
}

// update changes how a kept role is served to n: a new port is
// bound and a new simulated instance started before anything of the old
// stops, so an error (a port in use, a simulated instance that does not
// start) leaves the role as it was. The new upstream's probe starts once
// the old one's has ended, and its first probe decides the registration.
func (rs *roleServing) update(name string, n RoleConfig) error {
	rs.change.Lock()
	defer rs.change.Unlock()
	rs.mu.Lock()
	sr := rs.roles[name]
	closed := rs.closed
	rs.mu.Unlock()
	if closed {
		return errors.New("the agent is stopping")
	}
	if sr == nil {
		return fmt.Errorf("roles.%s: not served here", name)
	}
	src := rs.sourceOf(n)
	moved := n.Port != sr.port
	if !moved && src == sr.src {
		return nil
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Port))
	if moved {
		if err := rs.a.binder.hold(addr); err != nil {
			return fmt.Errorf("roles.%s.port: %w", name, err)
		}
	}
	if src != sr.src {
		up, err := rs.newSource(name, src)
		if err != nil {
			if moved {
				rs.a.binder.drop(addr)
			}
			return err
		}
		sr.up.stop()
		if up == nil {
			rs.deregister(name, sr.src)
		}
		up.run()
		sr.src, sr.up = src, up
	}
	if moved {
		rs.retireListener(name, sr, nil)
		sr.port = n.Port
		if err := rs.listen(name, sr); err != nil {
			// Only when the proxy is shutting down: the port was bound.
			return err
		}
	}
	return nil
}

// retire stops serving a removed role: its listener drains, then its
// upstream stops and, through the instance manager, its managed instance
// (instance is its spec, nil without one).
func (rs *roleServing) retire(name string, instance *provision.InstanceSpec) {
	rs.change.Lock()
	defer rs.change.Unlock()
	rs.mu.Lock()
	sr := rs.roles[name]
	if sr == nil || rs.closed {
		rs.mu.Unlock()
		return // stopping: close stops it
	}
	delete(rs.roles, name)
	rr := &retiringRole{up: sr.up, src: sr.src, instance: instance}
	rs.retiring[name] = rr
	rs.mu.Unlock()
	rs.a.mu.Lock()
	delete(rs.a.addrs, name)
	rs.a.mu.Unlock()
	rs.a.table.SetProxyPort(name, 0)
	rs.retireListener(name, sr, func() {
		rs.mu.Lock()
		mine := rs.retiring[name] == rr
		if mine {
			delete(rs.retiring, name)
		}
		closed := rs.closed
		rs.mu.Unlock()
		if !mine {
			return // added again meanwhile: the new role took over
		}
		sr.up.stop()
		rs.deregister(name, sr.src)
		if instance != nil && !closed {
			if err := rs.a.applyInstances(); err != nil {
				rs.a.log.Error("removing the instance of a removed role", zap.String("role", name), zap.Error(err))
			}
		}
		rs.a.log.Info("role removed", zap.String("role", name))
	})
}

// retireListener takes role name's listener out of the proxy and drains it
// on a goroutine of its own, for at most proxy.shutdown_timeout; then
// runs after (when not nil).
func (rs *roleServing) retireListener(name string, sr *servedRole, after func()) {
	drain, ok := rs.a.proxy.Retire(name)
	if l := rs.a.binder.take(sr.addr); l != nil {
		l.retire()
	}
	timeout := rs.a.config().Proxy.ShutdownTimeout
	addr := sr.addr
	rs.wg.Add(1)
	go func() {
		defer rs.wg.Done()
		if ok {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			err := drain(ctx)
			cancel()
			if err != nil {
				rs.a.log.Warn("drain of a retired port incomplete; cut remaining requests", zap.String("role", name), zap.String("addr", addr), zap.Error(err))
			} else {
				rs.a.log.Info("retired port drained and closed", zap.String("role", name), zap.String("addr", addr))
			}
		}
		if after != nil {
			after()
		}
	}()
}

// newSource prepares the probe of src for role name, and starts a
// simulated instance's server; run starts the probe. Managed instances and
// none have nothing here (nil). An error names the field.
func (rs *roleServing) newSource(name string, src roleSource) (*runningSource, error) {
	a := rs.a
	local := placement.Local{Base: src.base, Model: src.model, API: "openai", Runtime: "static"}
	var stopFn func()
	switch src.kind {
	case sourceStatic, sourceDev:
	case sourceSimulated:
		if a.opts.Simulated == nil {
			return nil, fmt.Errorf("roles.%s.instance.runtime: simulated: this agent has no built-in demo model", name)
		}
		base, stop, err := a.opts.Simulated(src.model)
		if err != nil {
			return nil, fmt.Errorf("roles.%s.instance: %w", name, err)
		}
		local.Base, local.Runtime, stopFn = base, provision.RuntimeSimulated, stop
	default:
		return nil, nil
	}
	return &runningSource{rs: rs, stopFn: stopFn, prober: &upstreamProber{
		role:     name,
		local:    local,
		reg:      a.table,
		client:   rs.client,
		interval: a.config().Proxy.HealthInterval,
		log:      a.log,
		key:      func() string { return a.upstreamKey(name) },
	}}, nil
}

// deregister forgets the local instance src registered for role name (a
// managed instance's is the instance manager's to forget).
func (rs *roleServing) deregister(name string, src roleSource) {
	if src.kind != "" && src.kind != sourceManaged {
		rs.a.table.DeregisterLocal(name)
	}
}

// retiringInstances are the managed instances of removed roles whose
// listener still drains.
func (rs *roleServing) retiringInstances() map[string]provision.InstanceSpec {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := map[string]provision.InstanceSpec{}
	for name, r := range rs.retiring {
		if r.instance != nil {
			out[name] = *r.instance
		}
	}
	return out
}

// running reports whether roleServing still takes changes.
func (rs *roleServing) running() bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return !rs.closed
}

// close stops the probes, waits for the drains of retired ports (each
// bounded by its timeout) and stops the simulated instances' servers.
// Listeners still in the proxy are its Shutdown's.
func (rs *roleServing) close() {
	rs.change.Lock()
	defer rs.change.Unlock()
	rs.mu.Lock()
	rs.closed = true
	var ups []*runningSource
	for _, r := range rs.roles {
		ups = append(ups, r.up)
	}
	for _, r := range rs.retiring {
		ups = append(ups, r.up)
	}
	rs.roles, rs.retiring = map[string]*servedRole{}, map[string]*retiringRole{}
	rs.mu.Unlock()
	rs.cancel()
	rs.wg.Wait()
	for _, up := range ups {
		up.stop()
	}
	rs.client.CloseIdleConnections()
}

// portBinder binds the role ports for the proxy (its Config.Listen goes
// through it) and remembers the listener behind each bound address, so
// that a reload can bind a role's new port before the old listener goes
// (a port in use then changes nothing) and retire the old one.
type portBinder struct {
	bind func(network, addr string) (net.Listener, error)

	mu   sync.Mutex
	held map[string]net.Listener // by address asked for: bound by hold, not yet taken by the proxy
	out  map[string]net.Listener // by bound address: handed to the proxy
}

func newPortBinder(bind func(network, addr string) (net.Listener, error)) *portBinder {
	return &portBinder{bind: bind, held: map[string]net.Listener{}, out: map[string]net.Listener{}}
}

// hold binds addr for the proxy's next listen there.
func (b *portBinder) hold(addr string) error {
	ln, err := b.bind("tcp", addr)
	if err != nil {
		return err
	}
	b.mu.Lock()
	prev := b.held[addr]
	b.held[addr] = ln
	b.mu.Unlock()
	if prev != nil {
		_ = prev.Close()
	}
	return nil
}

// drop closes what hold bound at addr, if the proxy did not take it.
func (b *portBinder) drop(addr string) {
	b.mu.Lock()
	ln := b.held[addr]
	delete(b.held, addr)
	b.mu.Unlock()
	if ln != nil {
		if g := asGated(ln); g != nil {
			g.retire() // never served: not for the next agent either
		}
		_ = ln.Close()
	}
}

// listen is the proxy's Config.Listen: what hold bound at addr, else a new
// listener.
func (b *portBinder) listen(network, addr string) (net.Listener, error) {
	b.mu.Lock()
	ln := b.held[addr]
	delete(b.held, addr)
	b.mu.Unlock()
	if ln == nil {
		var err error
		if ln, err = b.bind(network, addr); err != nil {
			return nil, err
		}
	}
	b.mu.Lock()
	b.out[ln.Addr().String()] = ln
	b.mu.Unlock()
	return ln, nil
}

// take returns the agent's own listener handed to the proxy at the bound
// address addr, and forgets it (nil when it is not a gated listener).
func (b *portBinder) take(addr string) *gatedListener {
	b.mu.Lock()
	defer b.mu.Unlock()
	ln := b.out[addr]
	delete(b.out, addr)
	return asGated(ln)
}

func asGated(ln net.Listener) *gatedListener {
	switch l := ln.(type) {
	case *gatedListener:
		return l
	case *gatedHandover:
		return l.gatedListener
	}
	return nil
}
