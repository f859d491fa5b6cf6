package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// MemberState is what this agent's mesh view says of a member.
type MemberState struct {
	// PublicKey is the member's node key (base64).
	PublicKey string
	// Admitted: admitted now; Why says why not.
	Admitted bool
	Why      string
}

// Membership is this agent's mesh view, where a join is observed. The
// agent satisfies it with its memberlist view and placement table. Safe
// for concurrent use; must not block.
type Membership interface {
	// Member returns the live member called name; ok is false when there
	// is none.
	Member(name string) (m MemberState, ok bool)
	// Advertises reports whether a fresh advert of role from node is held.
	Advertises(node, role string) bool
}

// Progress is one step of a node's life as the operator follows it.
type Progress struct {
	Time time.Time `json:"time"`
	Node string    `json:"node"`
	Run  uint64    `json:"run,omitempty"`
	// Kind is "stage" (Phase and Stage say where), "log" (Log), "done"
	// (converged) or "failed" (Stage failed, Message says why).
	Kind    string     `json:"kind"`
	Phase   Phase      `json:"phase,omitempty"`
	Stage   Stage      `json:"stage,omitempty"`
	Message string     `json:"message,omitempty"`
	Log     *LogRecord `json:"log,omitempty"`
	// Attempt numbers a failed connect attempt that is made again (kind
	// stage, stage connecting; Message says why and when).
	Attempt int `json:"attempt,omitempty"`
}

// Progress kinds.
const (
	ProgressStage  = "stage"
	ProgressLog    = "log"
	ProgressDone   = "done"
	ProgressFailed = "failed"
)

// ManagerConfig configures a Manager.
type ManagerConfig struct {
	// Intents stores every node's record; required.
	Intents IntentStore
	// Leases are the providers, one per kind; required.
	Leases []Lease
	// Clients makes the bootstrap sessions' clients; required.
	Clients ClientFactory
	// Membership is where joins are observed; required.
	Membership Membership
	// JoinTimeout bounds the wait for a started node to join. Default 3m.
	JoinTimeout time.Duration
	// PollInterval is how often the join is looked for. Default 200ms.
	PollInterval time.Duration
	// LogDir keeps the bootstrap log of each converged node
	// (<name>.log, NDJSON log records). "": not kept.
	LogDir string
	// OnProgress is told every step of every node but log lines (for the
	// audit). It must not block.
	OnProgress func(Progress)
	// TeardownTimeout bounds a teardown. Default 2m.
	TeardownTimeout time.Duration
	Logger          *zap.Logger
}

// Manager adds and removes nodes. Safe for concurrent use; one operation
// per node name at a time.
type Manager struct {
	cfg    ManagerConfig
	leases map[Kind]Lease
	log    *zap.Logger

	ctx    context.Context // ends at Close: in-flight adds tear down
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu   sync.Mutex
	busy map[string]string // node -> what runs on it ("add", "remove")
}

// NewManager validates cfg.
func NewManager(cfg ManagerConfig) (*Manager, error) {
	if cfg.Intents == nil || cfg.Clients == nil || cfg.Membership == nil || len(cfg.Leases) == 0 {
		return nil, errors.New("node manager: Intents, Leases, Clients and Membership are required")
	}
	if cfg.JoinTimeout <= 0 {
		cfg.JoinTimeout = 3 * time.Minute
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = 200 * time.Millisecond
	}
	if cfg.TeardownTimeout <= 0 {
		cfg.TeardownTimeout = 2 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	m := &Manager{cfg: cfg, leases: map[Kind]Lease{}, log: cfg.Logger, busy: map[string]string{}}
	for _, l := range cfg.Leases {
		m.leases[l.Kind()] = l
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	return m, nil
}

// Close cancels the adds in flight (each tears its node down) and waits
// for every operation to return.
func (m *Manager) Close() {
	m.cancel()
	m.wg.Wait()
}

// claim marks name busy with op, or says what already runs on it.
func (m *Manager) claim(name, op string) (release func(), err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ctx.Err() != nil {
		return nil, errors.New("node manager closed")
	}
	if other, ok := m.busy[name]; ok {
		return nil, fmt.Errorf("%w: node %s is being %s", ErrExists, name, map[string]string{"add": "added", "remove": "removed"}[other])
	}
	m.busy[name] = op
	m.wg.Add(1)
	return func() {
		m.mu.Lock()
		delete(m.busy, name)
		m.mu.Unlock()
		m.wg.Done()
	}, nil
}

// opCtx ends with ctx or when the manager closes.
func (m *Manager) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(m.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

func (m *Manager) lease(k Kind) (Lease, error) {
	l, ok := m.leases[k]
	if !ok {
		return nil, fmt.Errorf("provider %q is not available on this agent", k)
	}
	return l, nil
}

// tracker turns record changes into stage progress, once per change of
// phase or stage, and once per failed connect attempt.
type tracker struct {
	emit    func(Progress)
	phase   Phase
	stage   Stage
	attempt int
}

func (t *tracker) change(rec Record) {
	if rec.Phase == t.phase && rec.Stage == t.stage && rec.Attempt == t.attempt {
		return
	}
	t.phase, t.stage, t.attempt = rec.Phase, rec.Stage, rec.Attempt
	t.emit(Progress{Time: time.Now(), Node: rec.Spec.Name, Run: rec.Spec.Run, Kind: ProgressStage, Phase: rec.Phase, Stage: rec.Stage, Message: rec.Note, Attempt: rec.Attempt})
}

// Add brings the node spec describes into the mesh: its intent is stored,
// its lease created, the session installs what plan renders and starts
// the agent, and the join is awaited until the node is admitted with the
// key made on it and its adverts of the consumed roles arrived. progress
// (nil: none) sees every stage and log line. Any failure, and ctx ending,
// tears the node down; the error names the stage and why.
func (m *Manager) Add(ctx context.Context, spec Spec, plan Plan, progress func(Progress)) (Record, error) {
	if err := spec.Validate(); err != nil {
		return Record{}, nodeErr(ErrNode, spec.Name, err)
	}
	release, err := m.claim(spec.Name, "add")
	if err != nil {
		return Record{}, err
	}
	defer release()
	if recs, err := m.cfg.Intents.List(); err != nil {
		return Record{}, nodeErr(ErrNode, spec.Name, err)
	} else {
		for _, r := range recs {
			if r.Spec.Name == spec.Name {
				return Record{}, fmt.Errorf("%w: node %s is recorded (phase %s); `infermesh node remove %s` first", ErrExists, spec.Name, r.Phase, spec.Name)
			}
		}
	}
	lease, err := m.lease(spec.Provider)
	if err != nil {
		return Record{}, nodeErr(ErrProvider, spec.Name, err)
	}
	ctx, cancel := m.opCtx(ctx)
	defer cancel()

	emit := m.emitter(progress)
	sink := &progressSink{node: spec.Name, emit: progress}
	tr := &tracker{emit: emit}
	p, err := NewProvisioner(ProvisionerConfig{
		Lease: lease, Clients: m.cfg.Clients, Sink: sink, Intents: m.cfg.Intents,
		OnChange: tr.change, TeardownTimeout: m.cfg.TeardownTimeout,
	})
	if err != nil {
		return Record{}, err
	}
	fail := func(err error) (Record, error) {
		rec, _ := p.Record()
		var ne *Error
		msg, stage := err.Error(), rec.Stage
		if errors.As(err, &ne) {
			// The event names the node and the stage already: the
			// message is the reason.
			msg = ne.Reason
			if ne.Teardown != nil {
				msg += " (teardown failed too: " + ne.Teardown.Error() + "; the node is kept for `infermesh node remove`)"
			}
			if ne.Stage != "" {
				stage = ne.Stage
			}
		}
		emit(Progress{Time: time.Now(), Node: spec.Name, Run: spec.Run, Kind: ProgressFailed, Phase: rec.Phase, Stage: stage, Message: msg})
		return rec, err
	}
	if err := p.Start(ctx, spec, plan); err != nil {
		return fail(err)
	}
	rec, _ := p.Record()
	member, err := m.awaitJoin(ctx, rec)
	if err == nil {
		err = p.ObserveJoin(ctx, member)
	}
	if err != nil {
		tctx, tcancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.TeardownTimeout)
		defer tcancel()
		if terr := p.Stop(tctx); terr != nil {
			var ne *Error
			if errors.As(err, &ne) {
				ne.Teardown = terr
			}
		}
		return fail(err)
	}
	if err := sink.save(m.cfg.LogDir); err != nil {
		m.log.Warn("keeping the bootstrap log", zap.String("node", spec.Name), zap.Error(err))
	}
	rec, _ = p.Record()
	emit(Progress{Time: time.Now(), Node: spec.Name, Run: spec.Run, Kind: ProgressDone, Phase: rec.Phase, Stage: StageConverged,
		Message: fmt.Sprintf("joined as %s with key %s", rec.Member, rec.PublicKey)})
	// The converged node now belongs to its record in the state store:
	// its provisioner is let go without Close (which would tear it down).
	return rec, nil
}

func (m *Manager) emitter(progress func(Progress)) func(Progress) {
	return func(p Progress) {
		if m.cfg.OnProgress != nil {
			m.cfg.OnProgress(p)
		}
		if progress != nil {
			progress(p)
		}
	}
}

// awaitJoin waits until rec's node is a live admitted member with the key
// read back from it and advertises every consumed role.
func (m *Manager) awaitJoin(ctx context.Context, rec Record) (string, error) {
	deadline := time.NewTimer(m.cfg.JoinTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(m.cfg.PollInterval)
	defer tick.Stop()
	name := rec.Spec.Name
	for {
		missing := m.joinMissing(rec)
		if missing == "" {
			return name, nil
		}
		select {
		case <-ctx.Done():
			return "", &Error{Kind: ErrBootstrap, Node: name, Stage: StageCancelled, Reason: "cancelled while waiting for the join: " + missing, Err: ctx.Err()}
		case <-deadline.C:
			return "", &Error{Kind: ErrBootstrap, Node: name, Stage: StageWaitingForJoin,
				Reason: fmt.Sprintf("never joined within %v: %s", m.cfg.JoinTimeout, missing)}
		case <-tick.C:
		}
	}
}

// joinMissing says what is still missing for rec's node to count as
// joined ("" when nothing).
func (m *Manager) joinMissing(rec Record) string {
	name := rec.Spec.Name
	st, ok := m.cfg.Membership.Member(name)
	switch {
	case !ok:
		return "not a member of this agent's mesh view"
	case rec.PublicKey != "" && st.PublicKey != rec.PublicKey:
		return fmt.Sprintf("a member %s has key %s, not the key made on the host (%s)", name, st.PublicKey, rec.PublicKey)
	case !st.Admitted:
		return "a member but not admitted: " + st.Why
	}
	var roles []string
	for _, r := range rec.Spec.Roles {
		if r.Consumed && !m.cfg.Membership.Advertises(name, r.Name) {
			roles = append(roles, r.Name)
		}
	}
	if len(roles) > 0 {
		return "admitted, but no advert yet of " + strings.Join(roles, ", ")
	}
	return ""
}

// List returns every recorded node, sorted by name.
func (m *Manager) List() ([]Record, error) {
	recs, err := m.cfg.Intents.List()
	slices.SortFunc(recs, func(a, b Record) int { return strings.Compare(a.Spec.Name, b.Spec.Name) })
	return recs, err
}

// Busy reports what runs on name now ("" when nothing).
func (m *Manager) Busy(name string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.busy[name]
}

// Remove tears a recorded node down: its agent stops with its lease (the
// container removed, or what the bootstrap installed on the host undone),
// and its record is deleted. ErrUnknown when there is none. It finishes
// even if ctx ends first (only the manager's Close stops it).
func (m *Manager) Remove(ctx context.Context, name string, progress func(Progress)) (Record, error) {
	release, err := m.claim(name, "remove")
	if err != nil {
		return Record{}, err
	}
	defer release()
	// A removal runs to its end (or the agent's stop) even when its caller
	// goes away: half a removal helps nobody.
	ctx, cancel := m.opCtx(context.WithoutCancel(ctx))
	defer cancel()
	return m.teardown(ctx, name, progress)
}

func (m *Manager) teardown(ctx context.Context, name string, progress func(Progress)) (Record, error) {
	var rec Record
	recs, err := m.cfg.Intents.List()
	if err != nil {
		return Record{}, nodeErr(ErrNode, name, err)
	}
	found := false
	for _, r := range recs {
		if r.Spec.Name == name {
			rec, found = r, true
		}
	}
	if !found {
		return Record{}, fmt.Errorf("%w: %s", ErrUnknown, name)
	}
	lease, err := m.lease(rec.Spec.Provider)
	if err != nil {
		return rec, nodeErr(ErrProvider, name, err)
	}
	emit := m.emitter(progress)
	tr := &tracker{emit: emit, phase: rec.Phase, stage: rec.Stage}
	p, err := Adopt(ProvisionerConfig{
		Lease: lease, Clients: m.cfg.Clients, Intents: m.cfg.Intents,
		OnChange: tr.change, TeardownTimeout: m.cfg.TeardownTimeout,
	}, rec)
	if err != nil {
		return rec, err
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.TeardownTimeout)
	defer cancel()
	if err := p.Stop(ctx); err != nil {
		emit(Progress{Time: time.Now(), Node: name, Run: rec.Spec.Run, Kind: ProgressFailed, Phase: PhaseDestroying, Message: err.Error()})
		return rec, err
	}
	if m.cfg.LogDir != "" {
		_ = os.Remove(filepath.Join(m.cfg.LogDir, name+".log"))
	}
	emit(Progress{Time: time.Now(), Node: name, Run: rec.Spec.Run, Kind: ProgressDone, Phase: PhaseDestroyed, Message: "removed"})
	return rec, nil
}

// Recover runs once at agent start, before any add: every node the store
// records that had not converged (an add cut short by a crash or a stop)
// is torn down. Converged nodes stay. It returns the nodes torn down and
// the teardowns that failed (their records stay for `node remove`).
func (m *Manager) Recover(ctx context.Context) ([]string, error) {
	recs, err := m.List()
	if err != nil {
		return nil, err
	}
	var done []string
	var errs []error
	for _, r := range recs {
		if r.Phase == PhaseConverged {
			continue
		}
		release, err := m.claim(r.Spec.Name, "remove")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		m.log.Info("tearing down a node whose add did not finish", zap.String("node", r.Spec.Name), zap.String("phase", string(r.Phase)), zap.String("stage", string(r.Stage)))
		_, err = m.teardown(ctx, r.Spec.Name, nil)
		release()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done = append(done, r.Spec.Name)
	}
	return done, errors.Join(errs...)
}

// progressSink passes every log record on at once and keeps them, to be
// saved once the node converged (Flush): the kept log is complete, and a
// cancelled session leaves none.
type progressSink struct {
	node    string
	emit    func(Progress)
	mu      sync.Mutex
	records []LogRecord
	flushed []LogRecord
}

func (s *progressSink) Record(r LogRecord) {
	s.mu.Lock()
	s.records = append(s.records, r)
	s.mu.Unlock()
	if s.emit != nil {
		rec := r
		s.emit(Progress{Time: r.Time, Node: r.Node, Run: r.Run, Kind: ProgressLog, Log: &rec})
	}
}

func (s *progressSink) Flush() {
	s.mu.Lock()
	s.flushed = append(s.flushed, s.records...)
	s.records = nil
	s.mu.Unlock()
}

// save writes what was flushed to dir/<node>.log.
func (s *progressSink) save(dir string) error {
	s.mu.Lock()
	recs := s.flushed
	s.mu.Unlock()
	if dir == "" || len(recs) == 0 {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	var b strings.Builder
	for _, r := range recs {
		line, err := json.Marshal(r)
		if err != nil {
			return err
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	tmp := filepath.Join(dir, "."+s.node+".log.tmp")
	if err := os.WriteFile(tmp, []byte(b.String()), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, s.node+".log"))
}
