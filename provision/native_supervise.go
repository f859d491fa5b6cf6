package provision

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Process supervision of native instances: spawning the process group, attaching
// to one that outlived the agent, watching it exit, and stopping it.

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
