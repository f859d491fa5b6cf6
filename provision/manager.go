package provision

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/placement"
)

// Registrar is the part of the placement table the Manager drives: an
// instance is registered once it answers its health probe and deregistered
// when it stops answering. Methods must be safe for concurrent use and must
// not block. *placement.Table satisfies it.
type Registrar interface {
	RegisterLocal(role string, l placement.Local) error
	DeregisterLocal(role string)
}

var _ Registrar = (*placement.Table)(nil)

// InstanceProvider is what the Manager needs from a runtime: the provider
// contract plus status (endpoint, running or not). Safe for concurrent
// use; the Manager serializes calls per role. *DockerProvider and
// *NativeProvider satisfy it.
type InstanceProvider interface {
	Provider
	// Status reports ref's resource; ErrNotFound when it does not exist.
	Status(ctx context.Context, ref string) (ResourceStatus, error)
}

var _ InstanceProvider = (*DockerProvider)(nil)

// ManagerConfig configures a Manager. Zero values mean the default.
type ManagerConfig struct {
	// Providers run the instances, by runtime name (RuntimeDocker,
	// RuntimeNative); at least one is required. An instance whose runtime
	// has no provider is in StateError.
	Providers map[string]InstanceProvider
	// Intents is the durable intent store (required).
	Intents IntentStore
	// Registrar is told when instances are ready or gone (required),
	// e.g. the *placement.Table.
	Registrar Registrar
	// Logger; nil means zap.NewNop().
	Logger *zap.Logger
	// Events receives lifecycle events. Called from the manager's
	// goroutines; must not block. Nil discards.
	Events func(Event)

	// ProbeInterval between health probes. Default 2s.
	ProbeInterval time.Duration
	// ProbeTimeout bounds one probe. Default 2s.
	ProbeTimeout time.Duration
	// ReadyTimeout is how long a started instance may take to answer
	// (unless its spec's StartTimeout says otherwise), and how long a ready
	// one may stay silent, before it is restarted. Default 2m.
	ReadyTimeout time.Duration
	// UnhealthyAfter consecutive failed probes deregister a ready instance.
	// Default 3.
	UnhealthyAfter int
	// RetryBackoff is the first delay after a runtime error (daemon
	// unreachable, ...); it doubles up to MaxRetryBackoff. Defaults 1s, 30s.
	RetryBackoff    time.Duration
	MaxRetryBackoff time.Duration
	// OpTimeout bounds one provider operation. Default 2m.
	OpTimeout time.Duration
	// PullTimeout bounds fetching an instance's image. Default 1h.
	PullTimeout time.Duration
	// LogLines is the per-instance recent-log buffer. Default 500.
	LogLines int
	// ProbeKey, when set, returns the API key a role's instance requires
	// ("" for none): health probes carry it (Authorization: Bearer), as
	// the requests the agent forwards do, so a key-protected server
	// (LiteLLM's master key guards its health path too) is seen healthy.
	// Called for every probe, so a rotated key applies at once.
	ProbeKey func(role string) string
}

// DefaultManagerConfig returns the defaults (the required fields unset).
func DefaultManagerConfig() ManagerConfig {
	return ManagerConfig{
		ProbeInterval:   2 * time.Second,
		ProbeTimeout:    2 * time.Second,
		ReadyTimeout:    2 * time.Minute,
		UnhealthyAfter:  3,
		RetryBackoff:    time.Second,
		MaxRetryBackoff: 30 * time.Second,
		OpTimeout:       2 * time.Minute,
		PullTimeout:     time.Hour,
		LogLines:        500,
	}
}

func (c *ManagerConfig) fill() error {
	if len(c.Providers) == 0 {
		return errors.New("manager config: Providers is empty")
	}
	for name, p := range c.Providers {
		if p == nil {
			return fmt.Errorf("manager config: Providers[%q] is nil", name)
		}
	}
	if c.Intents == nil {
		return errors.New("manager config: Intents is nil")
	}
	if c.Registrar == nil {
		return errors.New("manager config: Registrar is nil")
	}
	d := DefaultManagerConfig()
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Events == nil {
		c.Events = func(Event) {}
	}
	defaults.Positive(&c.ProbeInterval, d.ProbeInterval)
	defaults.Positive(&c.ProbeTimeout, d.ProbeTimeout)
	defaults.Positive(&c.ReadyTimeout, d.ReadyTimeout)
	defaults.Positive(&c.RetryBackoff, d.RetryBackoff)
	defaults.Positive(&c.MaxRetryBackoff, d.MaxRetryBackoff)
	defaults.Positive(&c.OpTimeout, d.OpTimeout)
	defaults.Positive(&c.PullTimeout, d.PullTimeout)
	defaults.Positive(&c.UnhealthyAfter, d.UnhealthyAfter)
	defaults.Positive(&c.LogLines, d.LogLines)
	return nil
}

// ErrRunning is returned by Run when the manager already runs.
var ErrRunning = errors.New("manager already running")

// Manager reconciles the roles' desired instances with the runtime and
// supervises them: each role has one supervisor goroutine (owned by Run)
// that adopts or creates its container, probes it, registers it in
// placement and restarts it within its policy.
//
// Replacement on a spec change stops the old container before the new one
// is created (accelerator memory usually cannot hold both); the role does
// not serve in between. Changes that do not alter the container (model,
// health path, restart policy) re-supervise the running container without
// restarting it. On shutdown (Run's ctx done) containers keep running; the
// next Manager over the same IntentStore adopts them.
type Manager struct {
	cfg   ManagerConfig
	log   *zap.Logger
	probe *http.Client
	kick  chan struct{}

	mu        sync.Mutex
	desired   map[string]InstanceSpec
	applied   bool
	running   bool
	instances map[string]*instance // by role; read by Instances/Logs
	// replaced is closed (and forgotten) whenever instances changes, for
	// log followers; made on demand.
	replaced chan struct{}
}

// setInstanceLocked puts in as role's instance (nil: none); m.mu is held.
func (m *Manager) setInstanceLocked(role string, in *instance) {
	if in == nil {
		delete(m.instances, role)
	} else {
		m.instances[role] = in
	}
	if m.replaced != nil {
		close(m.replaced)
		m.replaced = nil
	}
}

// NewManager validates cfg and returns an idle manager: call Apply and Run.
func NewManager(cfg ManagerConfig) (*Manager, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	return &Manager{
		cfg: cfg,
		log: cfg.Logger,
		probe: &http.Client{
			Timeout: cfg.ProbeTimeout,
			// Probes must not reuse a connection to a container that was
			// replaced, nor keep idle connections (and goroutines) around.
			Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil},
			CheckRedirect: func(*http.Request, []*http.Request) error {
				return http.ErrUseLastResponse
			},
		},
		kick:      make(chan struct{}, 1),
		desired:   map[string]InstanceSpec{},
		instances: map[string]*instance{},
	}, nil
}

// Apply sets the desired instances by role (the whole set: roles missing
// from it are removed) and returns; Run converges to it. It rejects the
// whole set, naming the role and field, if any spec is invalid. Until the
// first Apply, Run only adopts nothing and removes nothing.
func (m *Manager) Apply(ctx context.Context, desired map[string]InstanceSpec) error {
	var errs []error
	next := make(map[string]InstanceSpec, len(desired))
	for role, s := range desired {
		if err := placement.ValidateRole(role); err != nil {
			errs = append(errs, fmt.Errorf("role %q: %w", role, err))
			continue
		}
		if err := s.validate(); err != nil {
			errs = append(errs, fmt.Errorf("role %s: instance: %w", role, err))
			continue
		}
		next[role] = cloneInstanceSpec(s)
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	m.mu.Lock()
	m.desired = next
	m.applied = true
	m.mu.Unlock()
	m.poke()
	return ctx.Err()
}

func (m *Manager) poke() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

func cloneInstanceSpec(s InstanceSpec) InstanceSpec {
	c := s
	c.Args = append([]string(nil), s.Args...)
	c.Mounts = append([]Mount(nil), s.Mounts...)
	if s.Env != nil {
		c.Env = make(map[string]string, len(s.Env))
		for k, v := range s.Env {
			c.Env[k] = v
		}
	}
	defaults.Zero(&c.Health, DefaultHealthPath)
	defaults.Zero(&c.Runtime, DefaultRuntime)
	c.Restart = s.Restart.withDefaults()
	return c
}

// Run supervises until ctx is done, then stops supervising (containers
// keep running), waits for its goroutines and returns nil.
func (m *Manager) Run(ctx context.Context) error {
	m.mu.Lock()
	if m.running {
		m.mu.Unlock()
		return ErrRunning
	}
	m.running = true
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		m.running = false
		m.mu.Unlock()
	}()

	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	for {
		if pending := m.reconcile(ctx, &wg); pending {
			retry.Reset(m.cfg.RetryBackoff)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-m.kick:
		case <-retry.C:
		}
	}
}

// reconcile starts, replaces and removes supervisors to match the desired
// set. It reports whether something is left to do later (intents could not
// be read, a removal is still in flight).
func (m *Manager) reconcile(ctx context.Context, wg *sync.WaitGroup) (pending bool) {
	m.mu.Lock()
	if !m.applied {
		m.mu.Unlock()
		return false
	}
	desired := m.desired
	current := make(map[string]*instance, len(m.instances))
	for r, in := range m.instances {
		current[r] = in
	}
	m.mu.Unlock()

	intents, err := m.cfg.Intents.Intents()
	if err != nil {
		m.log.Error("reading intents", zap.Error(err))
		return true
	}

	// Finished removals leave the table.
	for role, in := range current {
		if in.removing && in.finished() {
			m.mu.Lock()
			if m.instances[role] == in {
				m.setInstanceLocked(role, nil)
			}
			m.mu.Unlock()
			delete(current, role)
		}
	}

	for role, spec := range desired {
		in := current[role]
		if in != nil && in.removing {
			pending = true // wait for the removal, then start afresh
			continue
		}
		if in != nil && reflect.DeepEqual(in.spec, spec) {
			continue
		}
		if in != nil {
			in.stop() // the container stays; the new supervisor decides
		}
		attempt := pickAttempt(role, spec, intents)
		next := m.newInstance(role, spec, attempt)
		if in != nil {
			next.restarts = in.restartsTotal()
		}
		m.mu.Lock()
		m.setInstanceLocked(role, next)
		m.mu.Unlock()
		next.start(ctx, wg, (*instance).supervise)
	}

	// Roles no longer desired: supervised ones, and ones only known from
	// intents (removed from the config while the agent was down).
	gone := map[string]bool{}
	for role, in := range current {
		if _, ok := desired[role]; !ok && !in.removing {
			in.stop()
			gone[role] = true
		}
	}
	for _, s := range intents {
		if _, ok := desired[s.Role]; !ok && current[s.Role] == nil {
			gone[s.Role] = true
		}
	}
	for role := range gone {
		rm := m.newInstance(role, InstanceSpec{}, 0)
		rm.removing = true
		rm.setState(StateRemoving, "")
		m.mu.Lock()
		m.setInstanceLocked(role, rm)
		m.mu.Unlock()
		rm.start(ctx, wg, (*instance).remove)
	}
	return pending
}

// pickAttempt reuses the attempt of an intent with the same content (adopt
// it) or takes the next number after every attempt the role has had.
func pickAttempt(role string, spec InstanceSpec, intents map[string]ProvisionSpec) uint64 {
	want := spec.provisionSpec(role, 0).Hash()
	var same, highest uint64
	for _, s := range intents {
		if s.Role != role {
			continue
		}
		highest = max(highest, s.AttemptID)
		if s.Hash() == want {
			same = max(same, s.AttemptID)
		}
	}
	if same > 0 {
		return same
	}
	return highest + 1
}

// Instances returns the operator view of every instance, sorted by role.
func (m *Manager) Instances() []InstanceStatus {
	m.mu.Lock()
	list := make([]*instance, 0, len(m.instances))
	for _, in := range m.instances {
		list = append(list, in)
	}
	m.mu.Unlock()
	out := make([]InstanceStatus, 0, len(list))
	for _, in := range list {
		out = append(out, in.status())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Role < out[j].Role })
	return out
}

// Errors of Retry.
var (
	// ErrNoInstance: the role has no managed instance (or it is being
	// removed).
	ErrNoInstance = errors.New("no managed instance for the role")
	// ErrNotFailed: the instance is neither given up (StateFailed) nor
	// stopped (StateStopped); it is supervised.
	ErrNotFailed = errors.New("instance has not failed")
)

// Retry tries a failed or stopped instance afresh: a new supervisor with a
// fresh restart policy takes over its container (same attempt: the stopped
// container is started again, not recreated). Only an instance that gave up
// (StateFailed) or that the operator stopped (StateStopped) can be retried;
// a supervised one already restarts within its policy.
func (m *Manager) Retry(role string) error {
	m.mu.Lock()
	in, err := m.supervisedLocked(role)
	if err != nil {
		m.mu.Unlock()
		return err
	}
	if st := in.status().State; st != StateFailed && st != StateStopped {
		m.mu.Unlock()
		return fmt.Errorf("role %q is %s: %w", role, st, ErrNotFailed)
	}
	m.setInstanceLocked(role, nil)
	m.mu.Unlock()
	in.stop()
	m.log.Info("retrying failed instance", zap.String("role", role))
	m.poke()
	return nil
}

// supervisedLocked returns role's instance when the role is desired and
// not being removed, else ErrNoInstance. m.mu is held.
func (m *Manager) supervisedLocked(role string) (*instance, error) {
	in := m.instances[role]
	_, desired := m.desired[role]
	if in == nil || !desired || in.removing {
		return nil, fmt.Errorf("role %q: %w", role, ErrNoInstance)
	}
	return in, nil
}

// Instance returns one role's status.
func (m *Manager) Instance(role string) (InstanceStatus, bool) {
	m.mu.Lock()
	in, ok := m.instances[role]
	m.mu.Unlock()
	if !ok {
		return InstanceStatus{}, false
	}
	return in.status(), true
}

// Logs returns up to n recent lines of role's instance (n < 1: all kept).
func (m *Manager) Logs(role string, n int) []LogLine {
	m.mu.Lock()
	in, ok := m.instances[role]
	m.mu.Unlock()
	if !ok {
		return nil
	}
	return in.logs.Last(n)
}

// FollowLogs calls fn with up to n recent lines of role's instance (n < 1:
// all kept), then with every line added after them, until ctx ends (nil),
// fn returns an error (that error) or the role has no instance any more
// (an error wrapping ErrNoInstance). An instance replaced meanwhile (a
// retry, a changed spec, a removal in progress) is followed on in its
// successor, from the successor's first line; lines dropped from a ring
// before they were sent are counted in a line of stream "dropped".
func (m *Manager) FollowLogs(ctx context.Context, role string, n int, fn func(LogLine) error) error {
	var cur *instance
	var pos uint64
	first := true
	for {
		m.mu.Lock()
		in := m.instances[role]
		_, desired := m.desired[role]
		if m.replaced == nil {
			m.replaced = make(chan struct{})
		}
		replaced := m.replaced
		m.mu.Unlock()
		switch {
		case in == nil && !desired:
			return fmt.Errorf("role %q: %w", role, ErrNoInstance)
		case in == nil:
			// Between instances (a retry): the next one comes.
			select {
			case <-ctx.Done():
				return nil
			case <-replaced:
			}
			continue
		case in != cur:
			cur, pos = in, 0
			if first {
				var lines []LogLine
				lines, pos = in.logs.Tail(n)
				first = false
				for _, l := range lines {
					if err := fn(l); err != nil {
						return err
					}
				}
			}
		}
		lines, next, dropped, added := cur.logs.Since(pos)
		pos = next
		if dropped > 0 {
			if err := fn(LogLine{Time: time.Now(), Stream: "dropped", Line: fmt.Sprintf("%d line(s) not shown: they left the log before they could be sent", dropped)}); err != nil {
				return err
			}
		}
		for _, l := range lines {
			if err := fn(l); err != nil {
				return err
			}
		}
		if added == nil {
			continue // more may have come meanwhile
		}
		select {
		case <-ctx.Done():
			return nil
		case <-added:
		case <-replaced:
		}
	}
}

// Wanted returns the refs the manager still wants: those of its durable
// intents (written before a resource is created, deleted after it is gone)
// and of its instances. Everything else of this node and site is an orphan
// (cleanup.Sweeper).
func (m *Manager) Wanted() (map[string]bool, error) {
	intents, err := m.cfg.Intents.Intents()
	if err != nil {
		return nil, err
	}
	wanted := make(map[string]bool, len(intents))
	for ref := range intents {
		wanted[ref] = true
	}
	for _, st := range m.Instances() {
		if st.Ref != "" {
			wanted[st.Ref] = true
		}
	}
	return wanted, nil
}

// provider returns the provider of a runtime.
func (m *Manager) provider(runtime string) (InstanceProvider, error) {
	if runtime == "" {
		runtime = DefaultRuntime
	}
	p, ok := m.cfg.Providers[runtime]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrNoProvider, runtime)
	}
	return p, nil
}

// ErrNoProvider: an instance's runtime has no provider in this agent.
var ErrNoProvider = errors.New("no provider for the runtime")
