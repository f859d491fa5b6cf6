package provision

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/defaults"
)

// NativeConfig configures a NativeProvider. Zero values mean the default.
type NativeConfig struct {
	// Site and Node scope ownership, as DockerConfig's do: they are in
	// every ref and record, and only records naming both are acted on.
	// Required; token characters [A-Za-z0-9._-].
	Site string
	Node string
	// Dir is this node's folder in the site root (cleanup.Layout.NodeDir):
	// workload records and log files live there. Required, absolute.
	Dir string
	// CacheDir is this node's workload cache (cleanup.Layout.NodeCache):
	// each instance runs in CacheDir/<role>, which is also its HOME, TMPDIR
	// (unless its env sets them) and INFERMESH_CACHE_DIR. Required,
	// absolute.
	CacheDir string
	// StopTimeout is the grace period between SIGTERM and SIGKILL.
	// Default 10s.
	StopTimeout time.Duration
	// LogTail is how many past lines are replayed when adopting a running
	// process. Default 100.
	LogTail int
	// MaxLogBytes bounds each log file while the agent follows it.
	// Default 10 MiB.
	MaxLogBytes int64
	// PollInterval is how often log files are read for new lines.
	// Default 200ms.
	PollInterval time.Duration
	// Path is the PATH instances get unless their env sets one. Default
	// /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin.
	Path string
	// Logger; nil means zap.NewNop().
	Logger *zap.Logger
}

// DefaultNativeConfig returns the defaults (Site, Node, Dir and CacheDir
// still required).
func DefaultNativeConfig() NativeConfig {
	return NativeConfig{
		StopTimeout:  10 * time.Second,
		LogTail:      100,
		MaxLogBytes:  10 << 20,
		PollInterval: 200 * time.Millisecond,
		Path:         "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	}
}

func (c *NativeConfig) fill() error {
	if err := validToken(c.Site); err != nil {
		return fmt.Errorf("native config: Site: %w", err)
	}
	if err := validToken(c.Node); err != nil {
		return fmt.Errorf("native config: Node: %w", err)
	}
	if !filepath.IsAbs(c.Dir) {
		return fmt.Errorf("native config: Dir %q is not absolute", c.Dir)
	}
	if !filepath.IsAbs(c.CacheDir) {
		return fmt.Errorf("native config: CacheDir %q is not absolute", c.CacheDir)
	}
	d := DefaultNativeConfig()
	defaults.Positive(&c.StopTimeout, d.StopTimeout)
	defaults.Positive(&c.LogTail, d.LogTail)
	defaults.Positive(&c.MaxLogBytes, d.MaxLogBytes)
	defaults.Positive(&c.PollInterval, d.PollInterval)
	defaults.Zero(&c.Path, d.Path)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return nil
}

// NativeProvider implements Provider with processes on this host: an
// instance is a process the agent starts and supervises, with the same life
// as a container.
//
//   - The process leads its own session and process group (setsid), so it
//     is not killed with the agent and outlives an agent restart; stopping
//     it stops its whole group.
//   - Its stdout and stderr go to log files in the node folder, which the
//     agent follows (and follows again after adopting it).
//   - Its workload record (WorkloadRecord) is written before it starts and
//     completed once it runs. The record is the ownership evidence: the
//     process is adopted, stopped or reported running only while the pid,
//     start time, executable, boot and token all hold.
//
// Observations: stdout and stderr lines, the provider's own lines, and the
// end of each run: ObsExited with the exit status (nil when the process was
// adopted, so not this agent's child), or ObsFailed when a signal killed
// it. No telemetry.
//
// Safe for concurrent use; calls for one instance must be serialized by the
// caller.
type NativeProvider struct {
	ProviderDefaults

	cfg NativeConfig
	log *zap.Logger

	// watchCtx ends every watch on Close.
	watchCtx    context.Context
	watchCancel context.CancelFunc

	mu        sync.Mutex
	instances map[string]*nativeInstance // by ref
	closed    bool
	wg        sync.WaitGroup // watcher goroutines
}

// nativeInstance is the provider-local state of one instance.
type nativeInstance struct {
	// mu serializes the record's writes between the caller's operations
	// and the exit watcher.
	mu   sync.Mutex
	spec ProvisionSpec
	sink Sink
	run  *nativeRun // the watched run; nil when none is
}

// nativeRun is one watched run of a process.
type nativeRun struct {
	pid       int
	startTime uint64
	fd        *pidfd
	child     bool // started by this provider: it reaps it and knows its status
	cancel    context.CancelFunc
	exited    chan struct{} // closed once the process ended and the record says so
	done      chan struct{} // closed when the watch's goroutines ended
}

func (r *nativeRun) isExited() bool {
	select {
	case <-r.exited:
		return true
	default:
		return false
	}
}

var (
	_ Provider         = (*NativeProvider)(nil)
	_ InstanceProvider = (*NativeProvider)(nil)
	_ RefLister        = (*NativeProvider)(nil)
	_ InstanceStopper  = (*NativeProvider)(nil)
)

// NewNativeProvider returns a provider of native instances. Close stops its
// watchers; the processes keep running.
func NewNativeProvider(cfg NativeConfig) (*NativeProvider, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &NativeProvider{cfg: cfg, log: cfg.Logger, watchCtx: ctx, watchCancel: cancel,
		instances: map[string]*nativeInstance{}}, nil
}

// Config returns the provider's effective configuration.
func (p *NativeProvider) Config() NativeConfig { return p.cfg }

// Close stops following every instance and waits for that; the processes
// keep running (a restarted agent adopts them). Idempotent.
func (p *NativeProvider) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.watchCancel()
	p.wg.Wait()
	return nil
}

// ProviderRef is the instance's name, as for a container:
// infermesh-<site>-<node>-<role>-<attempt>.
func (p *NativeProvider) ProviderRef(spec ProvisionSpec) string {
	return resourceName(p.cfg.Site, p.cfg.Node, spec)
}

func (p *NativeProvider) recordPath(ref string) string { return recordPath(p.cfg.Dir, ref) }

// checkSpec validates a spec for this runtime.
func (p *NativeProvider) checkSpec(spec ProvisionSpec) error {
	if spec.Runtime != RuntimeNative {
		return fmt.Errorf("spec: runtime %q is not native", spec.RuntimeName())
	}
	if err := spec.Validate(); err != nil {
		return err
	}
	fi, err := os.Stat(spec.Command)
	if err != nil {
		return fmt.Errorf("%w: command: %w", ErrConfig, err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%w: command %s is not an executable file", ErrConfig, spec.Command)
	}
	return nil
}

// owned reports whether the record is this provider's: its site and node.
func (p *NativeProvider) owned(r WorkloadRecord) bool {
	return r.Site == p.cfg.Site && r.Node == p.cfg.Node
}

// readOwned reads ref's record: fs.ErrNotExist when there is none,
// ErrNotOwned when it names another site or node.
func (p *NativeProvider) readOwned(ref string) (WorkloadRecord, error) {
	rec, err := readRecord(p.recordPath(ref))
	if err != nil {
		return rec, err
	}
	if !p.owned(rec) || rec.Ref != ref {
		return rec, fmt.Errorf("workload record %s names %s/%s/%s: %w", p.recordPath(ref), rec.Site, rec.Node, rec.Ref, ErrNotOwned)
	}
	return rec, nil
}

func (p *NativeProvider) register(ref string, spec ProvisionSpec, sink Sink) *nativeInstance {
	if sink == nil {
		sink = Discard
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.instances[ref]
	if n == nil {
		n = &nativeInstance{}
		p.instances[ref] = n
	}
	n.spec, n.sink = spec.Clone(), sink
	return n
}

func (p *NativeProvider) instance(ref string) (*nativeInstance, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n, ok := p.instances[ref]
	return n, ok
}

// forget ends the watch of ref and drops it.
func (p *NativeProvider) forget(ref string) {
	p.mu.Lock()
	n, ok := p.instances[ref]
	delete(p.instances, ref)
	p.mu.Unlock()
	if ok {
		n.mu.Lock()
		if n.run != nil {
			n.run.cancel()
		}
		n.mu.Unlock()
	}
}

func (p *NativeProvider) handle(spec ProvisionSpec, ref string, pid int) InstanceHandle {
	h := InstanceHandle{InstanceID: spec.InstanceID, RunID: spec.RunID, Ref: ref}
	if pid > 0 {
		h.ResourceID, h.ProcessID = strconv.Itoa(pid), uint32(pid)
	}
	return h
}

func (p *NativeProvider) emit(sink Sink, spec ProvisionSpec, ref string, kind ObservationKind, line string) {
	o := Observation{Kind: kind, RunID: spec.RunID, InstanceID: spec.InstanceID, Ref: ref, Time: time.Now(), Line: line}
	sink.Observe(o)
}

// CreateInstance writes spec's workload record (state created) without
// starting anything: StartInstance starts the process. A record already
// there whose process runs the same spec is adopted; one whose process
// runs another spec has it stopped first.
func (p *NativeProvider) CreateInstance(ctx context.Context, spec ProvisionSpec, sink Sink) (InstanceHandle, error) {
	if err := p.checkSpec(spec); err != nil {
		return InstanceHandle{}, fmt.Errorf("create instance: %w", err)
	}
	ref := p.ProviderRef(spec)
	rec, err := p.readOwned(ref)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return InstanceHandle{}, fmt.Errorf("create instance: %w", err)
	default:
		ev, err := rec.Check()
		if err != nil {
			return InstanceHandle{}, fmt.Errorf("create instance %s: %w", ref, err)
		}
		switch ev.Liveness {
		case Forged:
			return InstanceHandle{}, fmt.Errorf("create instance %s: %w: %s", ref, ErrNotOwned, ev.Why)
		case Alive:
			if rec.SpecHash == spec.Hash() {
				a, ok, err := p.AdoptBySpec(ctx, spec, sink)
				if err == nil && ok {
					return a.Handle, nil
				}
			}
			if err := p.stopProcess(ctx, rec, ev); err != nil {
				return InstanceHandle{}, fmt.Errorf("create instance %s: replacing a stale process: %w", ref, err)
			}
		}
	}
	n := p.register(ref, spec, sink)
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	created := WorkloadRecord{
		Site: p.cfg.Site, Node: p.cfg.Node, Target: p.cfg.Node, Role: spec.Role, Ref: ref,
		RunID: spec.RunID, Attempt: spec.AttemptID, SpecHash: spec.Hash(),
		Command: spec.Command, Port: spec.Ports[0], State: WorkloadCreated, Created: now,
	}
	if err := writeRecord(p.recordPath(ref), created); err != nil {
		return InstanceHandle{}, fmt.Errorf("create instance: %w", err)
	}
	return p.handle(spec, ref, 0), nil
}

// StartInstance starts the instance's process (a no-op while it runs) and
// follows it. The record is rewritten first with a fresh token (state
// created), so a crash between starting the process and completing the
// record still leaves evidence that finds it (WorkloadRecord.Check).
func (p *NativeProvider) StartInstance(ctx context.Context, h InstanceHandle) error {
	n, ok := p.instance(h.Ref)
	if !ok {
		return fmt.Errorf("start %s: %w", h.Ref, ErrUnknownHandle)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.run != nil && !n.run.isExited() {
		return nil
	}
	rec, err := p.readOwned(h.Ref)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("start %s: %w: no workload record", h.Ref, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("start %s: %w", h.Ref, err)
	}
	ev, err := rec.Check()
	if err != nil {
		return fmt.Errorf("start %s: %w", h.Ref, err)
	}
	switch ev.Liveness {
	case Alive:
		return p.attachLocked(n, h.Ref, rec, ev, false)
	case Forged:
		return fmt.Errorf("start %s: %w: %s", h.Ref, ErrNotOwned, ev.Why)
	}
	if err := p.checkSpec(n.spec); err != nil {
		return fmt.Errorf("start %s: %w", h.Ref, err)
	}
	return p.spawnLocked(n, h.Ref, rec)
}

func (p *NativeProvider) HaltInstance(ctx context.Context, h InstanceHandle) error {
	n, ok := p.instance(h.Ref)
	if !ok {
		return nil
	}
	n.mu.Lock()
	run := n.run
	n.mu.Unlock()
	if run != nil && !run.isExited() {
		if err := stopGroup(ctx, run.fd, p.cfg.StopTimeout); err != nil {
			return fmt.Errorf("halt %s: %w", h.Ref, err)
		}
		select {
		case <-run.exited:
		case <-run.done: // the watch ended (closed) before seeing it
		case <-ctx.Done():
			return ctx.Err()
		}
		return nil
	}
	rec, err := p.readOwned(h.Ref)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("halt %s: %w", h.Ref, err)
	}
	ev, err := rec.Check()
	if err != nil {
		return fmt.Errorf("halt %s: %w", h.Ref, err)
	}
	if err := p.stopProcess(ctx, rec, ev); err != nil {
		return fmt.Errorf("halt %s: %w", h.Ref, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if rec.State != WorkloadExited {
		rec.State, rec.Exited = WorkloadExited, time.Now()
		return writeRecord(p.recordPath(h.Ref), rec)
	}
	return nil
}

func (p *NativeProvider) MarkLive(ctx context.Context, h InstanceHandle) error {
	n, ok := p.instance(h.Ref)
	if !ok {
		return fmt.Errorf("complete %s: %w", h.Ref, ErrUnknownHandle)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	run := n.run
	if run == nil || run.isExited() {
		return nil
	}
	exe, err := procExe(run.pid)
	if err != nil {
		return nil
	}
	if st, err := readProcStat(run.pid); err != nil || st.StartTime != run.startTime || run.fd.exited(0) {
		return nil
	}
	path := p.recordPath(h.Ref)
	rec, err := readRecord(path)
	if err != nil || rec.Pid != run.pid || rec.StartTime != run.startTime || rec.Executable == exe {
		return nil
	}
	rec.Executable = exe
	return writeRecord(path, rec)
}

// StopInstance stops the process group and removes the record and logs.
// Already gone is success.
func (p *NativeProvider) StopInstance(ctx context.Context, h InstanceHandle) error {
	if err := p.HaltInstance(ctx, h); err != nil {
		return err
	}
	p.forget(h.Ref)
	return p.removeResidue(h.Ref)
}

func (p *NativeProvider) removeResidue(ref string) error {
	return errors.Join(removeRecord(p.recordPath(ref)), removeLogs(p.cfg.Dir, ref))
}
