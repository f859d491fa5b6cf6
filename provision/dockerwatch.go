package provision

import (
	"bytes"
	"context"
	"fmt"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/pkg/stdcopy"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/ctxwait"
)

// maxLineLen bounds one observed log line; longer lines are split.
const maxLineLen = 16 << 10

// logsDrainGrace is how long the exit watcher waits for the log stream to
// drain, so an instance's last lines are observed before its exit. The
// engine ends a followed log stream once the container stopped, so the
// wait is normally short; the bound only matters when the stream is stuck,
// and a busy engine can take seconds to open one (2 s was seen to be too
// little with the machine's load average at 20).
const logsDrainGrace = 10 * time.Second

// watch starts streaming the logs of the container run described by info
// and watching for its exit, unless that run is already watched. The
// goroutines are owned by the provider: they end when the run ends, when
// the instance is forgotten, or on Close.
// since is where the run's log lines begin (see logsSince).
func (p *DockerProvider) watch(ref string, info container.InspectResponse, since string) {
	if info.State == nil {
		return
	}
	key := runKey(info)
	p.mu.Lock()
	n, ok := p.instances[ref]
	if !ok || p.closed || (n.runKey == key && n.cancel != nil) {
		p.mu.Unlock()
		return
	}
	if n.cancel != nil {
		n.cancel()
	}
	wctx, cancel := context.WithCancel(context.Background())
	n.runKey, n.cancel = key, cancel
	spec, sink, id := n.spec, n.sink, n.id
	p.wg.Add(2)
	p.mu.Unlock()

	logsDone := make(chan struct{})
	go func() {
		defer p.wg.Done()
		defer close(logsDone)
		p.streamLogs(wctx, ref, id, since, spec, sink)
	}()
	go func() {
		defer p.wg.Done()
		defer cancel()
		p.waitExit(wctx, ref, id, key, spec, sink, logsDone)
	}()
}

// logsSince is where a run's log lines begin: after the previous run
// finished. st must be inspected while that run is current or before it
// started (a finished run's FinishedAt is its own end). StartedAt would be
// wrong: the engine records it after the process is already running (and
// writing).
func logsSince(st *container.State) string {
	fin, err := time.Parse(time.RFC3339Nano, st.FinishedAt)
	if err != nil || fin.Year() < 2000 {
		return "" // never finished before: the whole log is this run
	}
	return fin.Add(time.Nanosecond).Format(time.RFC3339Nano)
}

func (p *DockerProvider) streamLogs(ctx context.Context, ref, id, since string, spec ProvisionSpec, sink Sink) {
	rc, err := p.api.ContainerLogs(ctx, id, container.LogsOptions{
		ShowStdout: true,
		ShowStderr: true,
		Follow:     true,
		Since:      since,
		Tail:       itoa(p.cfg.LogTail),
	})
	if err != nil {
		if ctx.Err() == nil {
			p.emit(sink, spec, ref, ObsProvider, "log stream: "+err.Error())
		}
		return
	}
	defer rc.Close()
	stdout := &lineWriter{emit: func(l string) { p.emit(sink, spec, ref, ObsStdout, l) }}
	stderr := &lineWriter{emit: func(l string) { p.emit(sink, spec, ref, ObsStderr, l) }}
	// Closing the body unblocks StdCopy when the watch is cancelled.
	stop := context.AfterFunc(ctx, func() { rc.Close() })
	defer stop()
	_, err = stdcopy.StdCopy(stdout, stderr, rc)
	stdout.flush()
	stderr.flush()
	if err != nil && ctx.Err() == nil {
		p.log.Debug("log stream ended", zap.String("ref", ref), zap.Error(err))
	}
}

// waitExit reports the end of the run key once, after its logs drained:
// ObsExited, or ObsFailed when the engine ended it (see runFailure) or the
// container vanished. A lost connection to the daemon is retried with
// backoff until the watch ends.
func (p *DockerProvider) waitExit(ctx context.Context, ref, id, key string, spec ProvisionSpec, sink Sink, logsDone <-chan struct{}) {
	backoff := 250 * time.Millisecond
	for {
		respC, errC := p.api.ContainerWait(ctx, id, container.WaitConditionNotRunning)
		select {
		case <-ctx.Done():
			return
		case resp := <-respC:
			t := time.NewTimer(logsDrainGrace)
			select {
			case <-logsDone:
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
			if ctx.Err() != nil {
				return
			}
			p.observeEnd(ctx, ref, id, key, spec, sink, int(resp.StatusCode))
			return
		case err := <-errC:
			if ctx.Err() != nil {
				return
			}
			if cerrdefs.IsNotFound(err) {
				// Removed behind our back (and, when the daemon was down,
				// never seen to stop): no status to report, and nothing
				// left to wait for.
				p.emit(sink, spec, ref, ObsFailed, "container "+shortID(id)+" vanished")
				return
			}
			p.emit(sink, spec, ref, ObsProvider, "exit watch: "+wrap("wait container", ref, err).Error())
			if !ctxwait.Sleep(ctx, backoff) {
				return
			}
			backoff = min(backoff*2, 10*time.Second)
		}
	}
}

// observeEnd reports how run key of container id ended with status: as
// ObsFailed when the engine says why it ended the run, else as ObsExited.
// The engine's state is only trusted while it still describes that run.
func (p *DockerProvider) observeEnd(ctx context.Context, ref, id, key string, spec ProvisionSpec, sink Sink, status int) {
	o := Observation{Kind: ObsExited, RunID: spec.RunID, InstanceID: spec.InstanceID, Ref: ref, Status: &status}
	for attempt := 0; ; attempt++ {
		info, err := p.inspect(ctx, id)
		if ctx.Err() != nil {
			return // forgotten meanwhile
		}
		if err == nil && info.State != nil && runKey(info) == key {
			if why := runFailure(info.State); why != "" {
				o.Kind, o.Reason = ObsFailed, why
				break
			}
		}
		// The engine records an OOM kill from its own event, which can
		// come after the exit the wait returned: a SIGKILL (137) is
		// looked at again for a moment before it counts as an exit.
		if status != 137 || attempt == oomRecheck || !ctxwait.Sleep(ctx, 100*time.Millisecond) {
			break
		}
	}
	o.Time = time.Now()
	sink.Observe(o)
}

// oomRecheck is how many more times a run killed by SIGKILL is inspected
// for the engine's OOM flag (100 ms apart).
const oomRecheck = 10

// runKey names one run of a container: a run is watched once.
func runKey(info container.InspectResponse) string {
	return info.ID + "@" + info.State.StartedAt
}

// runFailure says why the engine ended the container's last run, or ""
// when its process exited by itself (or still runs).
func runFailure(st *container.State) string {
	if st == nil || st.Running || !st.OOMKilled {
		return ""
	}
	return fmt.Sprintf("out of memory: killed at the container's memory limit (exit status %d)", st.ExitCode)
}

// lineWriter splits a byte stream into lines for observations.
type lineWriter struct {
	buf  []byte
	emit func(string)
}

func (w *lineWriter) Write(b []byte) (int, error) {
	w.buf = append(w.buf, b...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.emit(string(bytes.TrimSuffix(w.buf[:i], []byte("\r"))))
		w.buf = w.buf[i+1:]
	}
	for len(w.buf) >= maxLineLen {
		w.emit(string(w.buf[:maxLineLen]))
		w.buf = w.buf[maxLineLen:]
	}
	if len(w.buf) == 0 {
		w.buf = nil
	}
	return len(b), nil
}

func (w *lineWriter) flush() {
	if len(w.buf) > 0 {
		w.emit(string(w.buf))
		w.buf = nil
	}
}
