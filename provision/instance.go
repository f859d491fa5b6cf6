package provision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/ctxwait"
	"github.com/infermesh/infermesh/placement"
)

// maxRestartBackoff caps the doubling restart backoff.
const maxRestartBackoff = time.Minute

// instance is one role's supervisor (or, with removing set, its removal).
// Its goroutine is started by the Manager's Run loop and owned by it.
type instance struct {
	m        *Manager
	role     string
	spec     InstanceSpec
	intent   ProvisionSpec // this attempt's provider spec; zero for a removal
	p        InstanceProvider
	pErr     error // why p is nil: no provider for the spec's runtime
	ref      string
	removing bool
	logs     *LogRing
	endC     chan string // why a run ended (ObsExited, ObsFailed), coalesced

	cancel context.CancelFunc
	done   chan struct{}

	mu           sync.Mutex
	st           InstanceStatus
	restarts     int
	restartTimes []time.Time // within the policy window
}

var _ Sink = (*instance)(nil)

func (m *Manager) newInstance(role string, spec InstanceSpec, attempt uint64) *instance {
	in := &instance{
		m: m, role: role, spec: spec,
		logs: NewLogRing(m.cfg.LogLines),
		endC: make(chan string, 1),
		done: make(chan struct{}),
	}
	in.st = InstanceStatus{Role: role, State: StatePending, Runtime: spec.Runtime, Since: time.Now()}
	if attempt > 0 {
		in.intent = spec.provisionSpec(role, attempt)
		in.st.Image, in.st.Attempt, in.st.SpecHash = spec.Image, attempt, in.intent.Hash()
		if spec.Runtime == RuntimeNative {
			in.st.Image = spec.Command
		}
		if in.p, in.pErr = m.provider(spec.Runtime); in.p != nil {
			in.ref = in.p.ProviderRef(in.intent)
			in.st.Ref = in.ref
		}
	}
	return in
}

// resourceWord is what the instance's resource is called in messages.
func (in *instance) resourceWord() string {
	if in.spec.Runtime == RuntimeNative {
		return "process"
	}
	return "container"
}

// describe names the resource behind h: "container 0123456789ab" or
// "process 4242".
func (in *instance) describe(h InstanceHandle) string {
	if in.spec.Runtime == RuntimeNative {
		return "process " + h.ResourceID
	}
	return "container " + shortID(h.ResourceID)
}

func (in *instance) start(ctx context.Context, wg *sync.WaitGroup, fn func(*instance, context.Context)) {
	ctx, in.cancel = context.WithCancel(ctx)
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer in.m.poke() // let Run notice a finished removal
		defer close(in.done)
		fn(in, ctx)
	}()
}

// stop ends the goroutine and waits for it; the container is left as is.
func (in *instance) stop() {
	in.cancel()
	<-in.done
}

func (in *instance) finished() bool {
	select {
	case <-in.done:
		return true
	default:
		return false
	}
}

func (in *instance) restartsTotal() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.restarts
}

func (in *instance) status() InstanceStatus {
	in.mu.Lock()
	defer in.mu.Unlock()
	st := in.st
	st.Restarts = in.restarts
	return st
}

func (in *instance) setState(s InstanceState, lastErr string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.st.State != s {
		in.st.State, in.st.Since = s, time.Now()
	}
	if lastErr != "" {
		in.st.LastError = lastErr
	}
}

func (in *instance) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, in.m.cfg.OpTimeout)
}

func (in *instance) emit(kind EventKind, msg string) {
	e := Event{
		Kind: kind, RunID: in.intent.RunID, InstanceID: in.intent.InstanceID,
		Role: in.role, Ref: in.ref, Provider: in.spec.Runtime, Message: msg, Time: time.Now(),
	}
	in.mu.Lock()
	in.st.LastEvent = e
	in.mu.Unlock()
	in.logs.Add(LogLine{Time: e.Time, Stream: "event", Line: kind.String() + ": " + msg})
	lvl := zap.InfoLevel
	if kind == EventProvisionFailed {
		lvl = zap.WarnLevel
	}
	in.m.log.Log(lvl, kind.String(), zap.String("role", in.role), zap.String("ref", in.ref), zap.String("message", msg))
	in.m.cfg.Events(e)
}

// Observe records the instance's output and signals the end of its runs.
func (in *instance) Observe(o Observation) {
	switch o.Kind {
	case ObsExited, ObsFailed:
		why := o.Reason
		if o.Kind == ObsExited {
			why = "exited (exit status unknown: not this agent's child)"
			if o.Status != nil {
				why = exitedWith(*o.Status)
			}
		}
		in.logs.Add(LogLine{Time: o.Time, Stream: o.Kind.String(), Line: why})
		select {
		case in.endC <- why:
		default: // an end is already pending; serve re-checks the state anyway
		}
	case ObsTelemetry:
		in.logs.Add(LogLine{Time: o.Time, Stream: o.Kind.String(), Line: o.Channel + ": " + o.Payload})
	default:
		in.logs.Add(LogLine{Time: o.Time, Stream: o.Kind.String(), Line: o.Line})
	}
}

func exitedWith(status int) string { return fmt.Sprintf("exited with status %d", status) }

// supervise runs the role's instance until ctx is done: stop older attempts
// first, adopt or create and start the container, probe and register it,
// and restart it within the policy.
func (in *instance) supervise(ctx context.Context) {
	reg := in.m.cfg.Registrar
	defer reg.DeregisterLocal(in.role)
	if in.p == nil {
		in.setState(StateError, in.pErr.Error())
		in.emit(EventProvisionFailed, in.pErr.Error())
		<-ctx.Done()
		return
	}
	if !in.stopRole(ctx, in.ref) {
		return
	}
	for {
		h, ok := in.ensureRunning(ctx)
		if !ok {
			return
		}
		reason := in.serve(ctx, h)
		if ctx.Err() != nil {
			return
		}
		reg.DeregisterLocal(in.role)
		wait, ok := in.admitRestart()
		if !ok {
			in.giveUp(ctx, h, reason)
			<-ctx.Done()
			return
		}
		in.setState(StateRestarting, reason)
		in.m.log.Info("restarting instance", zap.String("role", in.role), zap.String("reason", reason), zap.Duration("backoff", wait))
		if !ctxwait.Sleep(ctx, wait) {
			return
		}
		// Stop what is left of the failed run (a process that stopped
		// answering) so ensureRunning starts it afresh.
		octx, cancel := in.opCtx(ctx)
		if err := in.p.HaltInstance(octx, h); err != nil {
			in.m.log.Warn("stopping failed instance", zap.String("role", in.role), zap.Error(err))
		}
		cancel()
	}
}

// admitRestart applies the restart policy: the backoff before the restart,
// or false when Max restarts already happened within Window.
func (in *instance) admitRestart() (time.Duration, bool) {
	pol := in.spec.Restart
	now := time.Now()
	in.mu.Lock()
	defer in.mu.Unlock()
	kept := in.restartTimes[:0]
	for _, t := range in.restartTimes {
		if now.Sub(t) < pol.Window {
			kept = append(kept, t)
		}
	}
	in.restartTimes = kept
	if len(kept) >= pol.Max {
		return 0, false
	}
	wait := pol.Backoff
	for i := 0; i < len(kept) && wait < maxRestartBackoff; i++ {
		wait *= 2
	}
	if wait > maxRestartBackoff && pol.Backoff <= maxRestartBackoff {
		wait = maxRestartBackoff
	}
	in.restartTimes = append(in.restartTimes, now)
	in.restarts++
	return wait, true
}

func (in *instance) giveUp(ctx context.Context, h InstanceHandle, reason string) {
	pol := in.spec.Restart
	msg := fmt.Sprintf("gave up after %d restarts within %v: %s", pol.Max, pol.Window, reason)
	in.setState(StateFailed, msg)
	in.emit(EventProvisionFailed, msg)
	// Free what the process holds (GPU memory); keep the container and
	// its logs for the operator.
	octx, cancel := in.opCtx(ctx)
	defer cancel()
	if err := in.p.HaltInstance(octx, h); err != nil {
		in.m.log.Warn("stopping failed instance", zap.String("role", in.role), zap.Error(err))
	}
}

// ensureRunning adopts the running container, or starts the existing one,
// or creates and starts it — retrying runtime errors (daemon unreachable)
// with backoff until ctx is done.
func (in *instance) ensureRunning(ctx context.Context) (InstanceHandle, bool) {
	backoff := in.m.cfg.RetryBackoff
	reported := false
	for {
		h, adopted, err := in.tryEnsure(ctx)
		if err == nil {
			in.mu.Lock()
			if in.spec.Runtime == RuntimeNative {
				in.st.PID = int(h.ProcessID)
			} else {
				in.st.ContainerID = h.ResourceID
			}
			in.mu.Unlock()
			if adopted {
				in.emit(EventProvisionStart, "adopted running "+in.describe(h))
			} else {
				in.emit(EventProvisionStart, "started "+in.describe(h))
			}
			return h, true
		}
		if ctx.Err() != nil {
			return InstanceHandle{}, false
		}
		if errors.Is(err, ErrConfig) {
			// Retrying cannot fix it: given up at once, until the operator
			// fixes the host or the config (instances retry, reload).
			msg := "gave up: " + err.Error()
			in.setState(StateFailed, msg)
			in.emit(EventProvisionFailed, msg)
			in.m.log.Error("instance cannot be provisioned", zap.String("role", in.role), zap.Error(err))
			<-ctx.Done()
			return InstanceHandle{}, false
		}
		in.setState(StateError, err.Error())
		if !reported {
			in.emit(EventProvisionFailed, err.Error())
			reported = true
		}
		in.m.log.Warn("provisioning instance", zap.String("role", in.role), zap.Error(err), zap.Duration("retry_in", backoff))
		if !ctxwait.Sleep(ctx, backoff) {
			return InstanceHandle{}, false
		}
		backoff = min(backoff*2, in.m.cfg.MaxRetryBackoff)
	}
}

func (in *instance) tryEnsure(ctx context.Context) (InstanceHandle, bool, error) {
	p := in.p
	// Durable intent first: a crash from here on leaves an intent to adopt
	// or clean up, never an untracked resource.
	if err := in.m.cfg.Intents.PutIntent(in.ref, in.intent); err != nil {
		return InstanceHandle{}, false, err
	}
	in.drainEnds()
	octx, cancel := in.opCtx(ctx)
	defer cancel()
	a, ok, err := p.AdoptBySpec(octx, in.intent, in)
	if err != nil {
		return InstanceHandle{}, false, fmt.Errorf("adopt: %w", err)
	}
	if ok {
		return a.Handle, true, nil
	}
	if ie, ok := p.(ImageEnsurer); ok {
		// Its own timeout: a large image takes longer than any operation.
		in.setState(StatePulling, "")
		pctx, pcancel := context.WithTimeout(ctx, in.m.cfg.PullTimeout)
		err := ie.EnsureImage(pctx, in.intent, in)
		pcancel()
		if err != nil {
			return InstanceHandle{}, false, err
		}
	}
	var h InstanceHandle
	if a, ok, err = p.PrepareBySpec(octx, in.intent, in); err != nil {
		return InstanceHandle{}, false, fmt.Errorf("prepare: %w", err)
	} else if ok {
		h = a.Handle
	} else if h, err = p.CreateInstance(octx, in.intent, in); err != nil {
		return InstanceHandle{}, false, err
	}
	in.setState(StateStarting, "")
	if err := p.StartInstance(octx, h); err != nil {
		return InstanceHandle{}, false, err
	}
	if h.ProcessID == 0 {
		// A process has its id only once started.
		if st, err := p.Status(octx, in.ref); err == nil && st.Pid > 0 && in.spec.Runtime == RuntimeNative {
			h.ResourceID, h.ProcessID = st.ID, uint32(st.Pid)
		}
	}
	return h, false, nil
}

func (in *instance) drainEnds() {
	for {
		select {
		case <-in.endC:
		default:
			return
		}
	}
}

// serve probes the running instance, registers it when it answers,
// deregisters it when it stops answering, and returns why it must be
// restarted: it exited or failed (ObsExited, ObsFailed, or the runtime's
// status says so), or it did not answer within ReadyTimeout. It returns ""
// when ctx is done.
func (in *instance) serve(ctx context.Context, h InstanceHandle) string {
	cfg := in.m.cfg
	reg := cfg.Registrar
	in.setState(StateStarting, "")
	ticker := time.NewTicker(cfg.ProbeInterval)
	defer ticker.Stop()

	var (
		endpoint   string
		registered bool
		answered   bool // ever, in this run: the start-up limit no longer applies
		fails      int
		silentFrom = time.Now() // since when it has not answered
	)
	for {
		if endpoint == "" {
			st, err := in.providerStatus(ctx)
			switch {
			case errors.Is(err, ErrNotFound):
				msg := in.resourceWord() + " disappeared"
				in.emit(EventInstanceStopped, msg)
				return msg
			case err != nil:
				in.m.log.Warn("instance status", zap.String("role", in.role), zap.Error(err))
			case !st.Running:
				msg := st.Failure
				if msg == "" {
					msg = exitedWith(st.ExitCode)
				}
				in.emit(EventInstanceStopped, msg)
				return msg
			default:
				endpoint = st.Endpoints[in.spec.Port]
				if endpoint == "" {
					return fmt.Sprintf("%s port %d is not published on loopback", in.resourceWord(), in.spec.Port)
				}
				in.mu.Lock()
				in.st.Endpoint = endpoint
				in.mu.Unlock()
			}
		}
		if endpoint != "" {
			if in.probeOnce(ctx, endpoint) {
				fails, silentFrom, answered = 0, time.Time{}, true
				if !registered {
					err := reg.RegisterLocal(in.role, placement.Local{
						Base: "http://" + endpoint, Model: in.spec.Model, API: "openai", Runtime: in.spec.Runtime,
					})
					if err != nil {
						in.setState(StateError, "register in placement: "+err.Error())
					} else {
						registered = true
						in.setState(StateReady, "")
						in.emit(EventInstanceLive, "ready at http://"+endpoint)
						octx, cancel := in.opCtx(ctx)
						_ = in.p.MarkLive(octx, h)
						cancel()
					}
				}
			} else {
				fails++
				if silentFrom.IsZero() {
					silentFrom = time.Now()
				}
				if registered && fails >= cfg.UnhealthyAfter {
					reg.DeregisterLocal(in.role)
					registered = false
					in.setState(StateUnhealthy, fmt.Sprintf("%d health probes failed", fails))
					in.m.log.Warn("instance stopped answering; deregistered", zap.String("role", in.role))
				}
			}
		}
		limit := cfg.ReadyTimeout
		if !answered && in.spec.StartTimeout > 0 {
			limit = in.spec.StartTimeout
		}
		if !registered && !silentFrom.IsZero() && time.Since(silentFrom) > limit {
			return fmt.Sprintf("no answer on %s for %v", in.spec.Health, limit)
		}
		select {
		case <-ctx.Done():
			return ""
		case msg := <-in.endC:
			// The end of an earlier run can arrive late; trust the
			// runtime's current state when it can tell.
			if st, err := in.providerStatus(ctx); err == nil && st.Running {
				continue
			}
			if registered {
				reg.DeregisterLocal(in.role)
			}
			in.emit(EventInstanceStopped, msg)
			return msg
		case <-ticker.C:
		}
	}
}

func (in *instance) providerStatus(ctx context.Context) (ResourceStatus, error) {
	octx, cancel := in.opCtx(ctx)
	defer cancel()
	return in.p.Status(octx, in.ref)
}

// probeOnce is one GET of the health path; any 2xx is healthy.
func (in *instance) probeOnce(ctx context.Context, endpoint string) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+endpoint+in.spec.Health, nil)
	if err != nil {
		return false
	}
	if in.m.cfg.ProbeKey != nil {
		if k := in.m.cfg.ProbeKey(in.role); k != "" {
			req.Header.Set("Authorization", "Bearer "+k)
		}
	}
	resp, err := in.m.probe.Do(req)
	if err != nil {
		return false
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	return resp.StatusCode >= 200 && resp.StatusCode < 300
}

// remove stops every container of a role that is no longer desired and
// deletes its intents, retrying until done or ctx is done.
func (in *instance) remove(ctx context.Context) {
	in.m.cfg.Registrar.DeregisterLocal(in.role)
	if in.stopRole(ctx, "") {
		in.emit(EventInstanceStopped, "role removed; instance stopped")
	}
}

// stopRole stops and forgets every attempt of the role recorded in the
// intents except keep, retrying with backoff. It reports false when ctx
// ended first.
func (in *instance) stopRole(ctx context.Context, keep string) bool {
	backoff := in.m.cfg.RetryBackoff
	for {
		err := in.tryStopRole(ctx, keep)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		in.setState(in.status().State, err.Error())
		in.m.log.Warn("stopping old instance", zap.String("role", in.role), zap.Error(err), zap.Duration("retry_in", backoff))
		if !ctxwait.Sleep(ctx, backoff) {
			return false
		}
		backoff = min(backoff*2, in.m.cfg.MaxRetryBackoff)
	}
}

func (in *instance) tryStopRole(ctx context.Context, keep string) error {
	intents, err := in.m.cfg.Intents.Intents()
	if err != nil {
		return err
	}
	var errs []error
	for ref, s := range intents {
		if s.Role != in.role || ref == keep {
			continue
		}
		p, err := in.m.provider(s.RuntimeName())
		if err != nil {
			errs = append(errs, fmt.Errorf("stop %s: %w", ref, err))
			continue
		}
		octx, cancel := in.opCtx(ctx)
		found, err := p.StopBySpec(octx, s, in)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("stop %s: %w", ref, err))
			continue
		}
		if err := in.m.cfg.Intents.DeleteIntent(ref); err != nil {
			errs = append(errs, err)
			continue
		}
		what := "forgot the intent of an absent resource"
		if found {
			what = "stopped and removed"
		}
		in.logs.Add(LogLine{Time: time.Now(), Stream: "provider", Line: what + " " + ref})
		in.m.log.Info(what, zap.String("role", in.role), zap.String("ref", ref))
	}
	return errors.Join(errs...)
}

// String is for logs.
func (s InstanceStatus) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s %s", s.Role, s.State, s.Ref)
	if s.LastError != "" {
		fmt.Fprintf(&b, " (%s)", s.LastError)
	}
	return b.String()
}
