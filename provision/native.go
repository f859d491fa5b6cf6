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
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

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

// CreateInstanceSelected refuses any exact offer: a host has no offers.
func (p *NativeProvider) CreateInstanceSelected(ctx context.Context, spec ProvisionSpec, sink Sink, offer *uint64) (InstanceHandle, error) {
	return CreateInstanceSelectedDefault(ctx, p, spec, sink, offer)
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

// spawnLocked starts the process of rec (n.mu held).
func (p *NativeProvider) spawnLocked(n *nativeInstance, ref string, rec WorkloadRecord) error {
	spec := n.spec
	boot, err := bootID()
	if err != nil {
		return fmt.Errorf("start %s: boot id: %w", ref, err)
	}
	rec.State, rec.Token = WorkloadCreated, newToken()
	rec.Pid, rec.StartTime, rec.Executable, rec.BootID = 0, 0, "", ""
	path := p.recordPath(ref)
	if err := writeRecord(path, rec); err != nil {
		return fmt.Errorf("start %s: %w", ref, err)
	}

	outPath, errPath := logPaths(p.cfg.Dir, ref)
	stdout, err := openLog(outPath)
	if err != nil {
		return fmt.Errorf("start %s: log: %w", ref, err)
	}
	defer stdout.Close()
	stderr, err := openLog(errPath)
	if err != nil {
		return fmt.Errorf("start %s: log: %w", ref, err)
	}
	defer stderr.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer devnull.Close()
	work := filepath.Join(p.cfg.CacheDir, spec.Role)
	if spec.Role == "" {
		work = filepath.Join(p.cfg.CacheDir, ref)
	}
	if err := os.MkdirAll(work, 0o700); err != nil {
		return fmt.Errorf("start %s: workload cache: %w", ref, err)
	}
	outFrom, errFrom := fileSize(outPath), fileSize(errPath)

	// TMPDIR is the cache too: under systemd the unit's private /tmp is
	// replaced when the agent restarts, and the process outlives that.
	env := []string{"PATH=" + p.cfg.Path, "HOME=" + work, "TMPDIR=" + work}
	for _, e := range spec.Env {
		env = append(env, e.Name+"="+e.Value)
	}
	env = append(env,
		"INFERMESH_SITE="+p.cfg.Site, "INFERMESH_NODE="+p.cfg.Node, "INFERMESH_ROLE="+spec.Role,
		"INFERMESH_WORKLOAD="+ref, "INFERMESH_CACHE_DIR="+work, TokenEnv+"="+rec.Token)
	proc, err := os.StartProcess(spec.Command, append([]string{spec.Command}, spec.Args...), &os.ProcAttr{
		Dir:   work,
		Env:   dedupEnv(env),
		Files: []*os.File{devnull, stdout, stderr},
		// Its own session and process group: signals to the agent's
		// group (a terminal's ^C, a unit's KillMode=process stop) do not
		// reach it, and the whole group can be stopped as one.
		Sys: &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		rec.State, rec.Exited = WorkloadExited, time.Now()
		_ = writeRecord(path, rec)
		return fmt.Errorf("start %s: %w", ref, err)
	}
	pid := proc.Pid
	_ = proc.Release() // this provider reaps it (watch), through its own pidfd
	// The child cannot be reaped by anyone else, so its pid is its own
	// until the watch reaps it.
	st, _ := readProcStat(pid) // parsed even when it already exited (zombie)
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("start %s: pidfd: %w", ref, err)
	}
	exe, err := procExe(pid)
	if err != nil {
		exe, _ = filepath.EvalSymlinks(spec.Command) // it exited already; the watch reports it
	}
	rec.State, rec.Pid, rec.StartTime, rec.Executable, rec.BootID, rec.Started = WorkloadRunning, pid, st.StartTime, exe, boot, time.Now()
	rec.ExitStatus, rec.Exited = nil, time.Time{}
	werr := writeRecord(path, rec)
	run := &nativeRun{pid: pid, startTime: st.StartTime, fd: &pidfd{fd: fd, pid: pid}, child: true}
	p.watchLocked(n, ref, run, outFrom, errFrom)
	p.emit(n.sink, spec, ref, ObsProvider, fmt.Sprintf("started process %d: %s", pid, spec.Command))
	if werr != nil {
		// The process runs and is watched; its token still finds it.
		return fmt.Errorf("start %s: completing the record of pid %d: %w", ref, pid, werr)
	}
	return nil
}

// dedupEnv keeps the last value of every name, in first-seen order.
func dedupEnv(env []string) []string {
	idx := map[string]int{}
	var out []string
	for _, kv := range env {
		name := kv
		for i := 0; i < len(kv); i++ {
			if kv[i] == '=' {
				name = kv[:i]
				break
			}
		}
		if i, ok := idx[name]; ok {
			out[i] = kv
			continue
		}
		idx[name] = len(out)
		out = append(out, kv)
	}
	return out
}

// attachLocked follows the live process ev names (adopted: not our child),
// completing a created record it was found from (n.mu held).
func (p *NativeProvider) attachLocked(n *nativeInstance, ref string, rec WorkloadRecord, ev Evidence, replay bool) error {
	if n.run != nil && !n.run.isExited() && n.run.pid == ev.Pid && n.run.startTime == ev.StartTime {
		return nil // already followed
	}
	fd, err := openPidfd(ev.Pid, ev.StartTime)
	if errors.Is(err, errNoProcess) {
		return fmt.Errorf("adopt %s: pid %d: %w", ref, ev.Pid, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("adopt %s: %w", ref, err)
	}
	if rec.State != WorkloadRunning {
		boot, err := bootID()
		if err != nil {
			fd.close()
			return err
		}
		exe, err := procExe(ev.Pid)
		if err != nil {
			fd.close()
			return fmt.Errorf("adopt %s: %w", ref, err)
		}
		rec.State, rec.Pid, rec.StartTime, rec.Executable, rec.BootID = WorkloadRunning, ev.Pid, ev.StartTime, exe, boot
		if rec.Started.IsZero() {
			rec.Started = time.Now()
		}
		if err := writeRecord(p.recordPath(ref), rec); err != nil {
			fd.close()
			return fmt.Errorf("adopt %s: %w", ref, err)
		}
	}
	outPath, errPath := logPaths(p.cfg.Dir, ref)
	outFrom, errFrom := fileSize(outPath), fileSize(errPath)
	if replay {
		outFrom, errFrom = tailOffset(outPath, p.cfg.LogTail), tailOffset(errPath, p.cfg.LogTail)
	}
	p.watchLocked(n, ref, &nativeRun{pid: ev.Pid, startTime: ev.StartTime, fd: fd}, outFrom, errFrom)
	return nil
}

// watchLocked starts following run: its log files from the given offsets,
// and its exit (n.mu held). The goroutines are owned by the provider.
func (p *NativeProvider) watchLocked(n *nativeInstance, ref string, run *nativeRun, outFrom, errFrom int64) {
	if old := n.run; old != nil {
		old.cancel() // its watch ends by itself and closes its pidfd
	}
	run.exited, run.done = make(chan struct{}), make(chan struct{})
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		run.cancel = func() {}
		run.fd.close()
		close(run.done)
		n.run = run
		return
	}
	ctx, cancel := context.WithCancel(p.watchCtx)
	run.cancel = cancel
	n.run = run
	p.wg.Add(1)
	p.mu.Unlock()

	spec, sink := n.spec, n.sink
	outPath, errPath := logPaths(p.cfg.Dir, ref)
	final := make(chan struct{})
	var tails sync.WaitGroup
	for _, t := range []struct {
		path string
		from int64
		kind ObservationKind
	}{{outPath, outFrom, ObsStdout}, {errPath, errFrom, ObsStderr}} {
		kind := t.kind
		tl := &tailer{path: t.path, offset: t.from, maxBytes: p.cfg.MaxLogBytes, poll: p.cfg.PollInterval,
			emit: func(l string) { p.emit(sink, spec, ref, kind, l) }}
		tails.Add(1)
		go func() {
			defer tails.Done()
			tl.run(ctx, final)
		}()
	}
	go func() {
		defer p.wg.Done()
		defer close(run.done)
		defer run.fd.close()
		defer tails.Wait()
		defer cancel()
		for !run.fd.exited(250 * time.Millisecond) {
			if ctx.Err() != nil {
				return
			}
		}
		o := Observation{Kind: ObsExited, RunID: spec.RunID, InstanceID: spec.InstanceID, Ref: ref}
		// Reap it when it is this process's child: the one it started, or
		// one an earlier provider in this process started and this one
		// adopted. Any other process's child is not ours to wait for
		// (ECHILD), and its status is unknown.
		flags := unix.WNOHANG
		if run.child {
			flags = 0
		}
		var ws unix.WaitStatus
		if wpid, err := unix.Wait4(run.pid, &ws, flags, nil); err == nil && wpid == run.pid {
			switch {
			case ws.Signaled():
				status := 128 + int(ws.Signal())
				o.Kind, o.Status = ObsFailed, &status
				o.Reason = fmt.Sprintf("killed by signal %d (%v)", int(ws.Signal()), ws.Signal())
			case ws.Exited():
				status := ws.ExitStatus()
				o.Status = &status
			}
		}
		p.markExited(n, ref, run, o.Status)
		close(run.exited)
		// Its last lines before its end.
		close(final)
		t := time.NewTimer(logsDrainGrace)
		drained := make(chan struct{})
		go func() { tails.Wait(); close(drained) }()
		select {
		case <-drained:
		case <-t.C:
		}
		t.Stop()
		if ctx.Err() != nil {
			return // forgotten or closed meanwhile: nobody is told
		}
		o.Time = time.Now()
		sink.Observe(o)
	}()
}

// markExited records that run ended, if the record still describes it.
func (p *NativeProvider) markExited(n *nativeInstance, ref string, run *nativeRun, status *int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	path := p.recordPath(ref)
	rec, err := readRecord(path)
	if err != nil || rec.State != WorkloadRunning || rec.Pid != run.pid || rec.StartTime != run.startTime {
		return
	}
	rec.State, rec.ExitStatus, rec.Exited = WorkloadExited, status, time.Now()
	if err := writeRecord(path, rec); err != nil {
		p.log.Warn("marking a native instance exited", zap.String("ref", ref), zap.Error(err))
	}
}

// HaltInstance stops the instance's process group, keeping its record and
// logs (StartInstance starts it again).
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

// stopProcess stops the process group ev found alive for rec; a process
// that is gone needs nothing, and evidence that does not hold refuses.
func (p *NativeProvider) stopProcess(ctx context.Context, rec WorkloadRecord, ev Evidence) error {
	switch ev.Liveness {
	case Gone, Reused:
		return nil
	case Forged:
		return fmt.Errorf("%w: %s", ErrNotOwned, ev.Why)
	}
	fd, err := openPidfd(ev.Pid, ev.StartTime)
	if errors.Is(err, errNoProcess) {
		return nil
	}
	if err != nil {
		return err
	}
	defer fd.close()
	return stopGroup(ctx, fd, p.cfg.StopTimeout)
}

// MarkLive refreshes the recorded executable: a wrapper that exec'd the
// server (sh -c 'exec ...') now runs another one. The process is known by
// the pidfd this provider holds, so this is not a new trust decision.
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

// lookupSpec reads spec's record and checks its evidence. ok is false when
// there is no record or it is of another content (hash); a record whose
// evidence is forged is an error.
func (p *NativeProvider) lookupSpec(spec ProvisionSpec) (ref string, rec WorkloadRecord, ev Evidence, ok bool, err error) {
	ref = p.ProviderRef(spec)
	rec, err = p.readOwned(ref)
	if errors.Is(err, fs.ErrNotExist) {
		return ref, rec, ev, false, nil
	}
	if err != nil {
		return ref, rec, ev, false, err
	}
	if rec.SpecHash != spec.Hash() {
		return ref, rec, ev, false, nil
	}
	if ev, err = rec.Check(); err != nil {
		return ref, rec, ev, false, fmt.Errorf("%s: %w", ref, err)
	}
	if ev.Liveness == Forged {
		return ref, rec, ev, false, fmt.Errorf("%s: %w: %s", ref, ErrNotOwned, ev.Why)
	}
	return ref, rec, ev, true, nil
}

// AdoptBySpec adopts spec's process if its record is ours, has spec's hash
// and its evidence holds: it is followed from its last LogTail lines. A
// process that is gone (or whose pid another process has now) is not
// adopted (ok false); a record whose evidence is forged is an error.
func (p *NativeProvider) AdoptBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	ref, rec, ev, ok, err := p.lookupSpec(spec)
	if err != nil || !ok || ev.Liveness != Alive {
		return AdoptedInstance{}, false, err
	}
	n := p.register(ref, spec, sink)
	n.mu.Lock()
	err = p.attachLocked(n, ref, rec, ev, true)
	n.mu.Unlock()
	if errors.Is(err, ErrNotFound) {
		return AdoptedInstance{}, false, nil // exited just now
	}
	if err != nil {
		return AdoptedInstance{}, false, err
	}
	p.emit(n.sink, spec, ref, ObsProvider, fmt.Sprintf("adopted running process %d", ev.Pid))
	h := p.handle(spec, ref, ev.Pid)
	return AdoptedInstance{Handle: h, Ref: ref, Running: true}, true, nil
}

// PrepareBySpec registers the handle of spec's record (ours, same hash, in
// any state) without starting anything. It never starts a process: ok is
// false when there is no record.
func (p *NativeProvider) PrepareBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	ref, rec, ev, ok, err := p.lookupSpec(spec)
	if err != nil || !ok {
		return AdoptedInstance{}, false, err
	}
	n := p.register(ref, spec, sink)
	pid := 0
	if ev.Liveness == Alive {
		n.mu.Lock()
		if p.attachLocked(n, ref, rec, ev, true) == nil {
			pid = ev.Pid
		}
		n.mu.Unlock()
	}
	return AdoptedInstance{Handle: p.handle(spec, ref, pid), Ref: ref, Running: pid > 0}, true, nil
}

// StopBySpec stops spec's process group if its record is ours (whatever its
// hash) and removes the record and logs. It returns false when there is no
// record.
func (p *NativeProvider) StopBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (bool, error) {
	ref := p.ProviderRef(spec)
	if _, err := p.readOwned(ref); errors.Is(err, fs.ErrNotExist) {
		p.forget(ref)
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("stop %s: %w", ref, err)
	}
	if _, ok := p.instance(ref); !ok {
		p.register(ref, spec, sink)
	}
	if err := p.HaltInstance(ctx, InstanceHandle{Ref: ref}); err != nil {
		return false, err
	}
	p.forget(ref)
	if err := p.removeResidue(ref); err != nil {
		return false, err
	}
	if sink != nil {
		p.emit(sink, spec, ref, ObsProvider, "stopped process and removed its record "+ref)
	}
	return true, nil
}

// Status reports ref's process from its record and the live system
// (ErrNotFound without a record, ErrNotOwned for another site's or node's,
// or a record whose evidence is forged). Its endpoint is 127.0.0.1:<port>.
func (p *NativeProvider) Status(ctx context.Context, ref string) (ResourceStatus, error) {
	rec, err := p.readOwned(ref)
	if errors.Is(err, fs.ErrNotExist) {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, ErrNotFound)
	}
	if err != nil {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, err)
	}
	st := ResourceStatus{Endpoints: map[int]string{rec.Port: "127.0.0.1:" + strconv.Itoa(rec.Port)}, ExitCode: -1}
	if rec.ExitStatus != nil {
		st.ExitCode = *rec.ExitStatus
	}
	if n, ok := p.instance(ref); ok {
		n.mu.Lock()
		run := n.run
		n.mu.Unlock()
		if run != nil && !run.isExited() && !run.fd.exited(0) {
			st.Running, st.Pid, st.ID, st.StartedAt = true, run.pid, strconv.Itoa(run.pid), rec.Started
			return st, nil
		}
	}
	ev, err := rec.Check()
	if err != nil {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, err)
	}
	switch ev.Liveness {
	case Forged:
		return ResourceStatus{}, fmt.Errorf("status %s: %w: %s", ref, ErrNotOwned, ev.Why)
	case Alive:
		st.Running, st.Pid, st.ID, st.StartedAt = true, ev.Pid, strconv.Itoa(ev.Pid), rec.Started
	}
	return st, nil
}

// ListManagedRefs lists the refs of this node's records of this site.
func (p *NativeProvider) ListManagedRefs(ctx context.Context) ([]string, error) {
	recs, err := findRecords(p.cfg.Dir, true)
	if err != nil {
		return nil, err
	}
	var refs []string
	for _, r := range recs {
		if r.Err == nil && p.owned(r.Rec) {
			refs = append(refs, r.Rec.Ref)
		}
	}
	return refs, nil
}
