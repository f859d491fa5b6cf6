package provision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/api/types/network"
	"github.com/docker/docker/client"
	"github.com/docker/go-connections/nat"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/defaults"
)

// Label keys the Docker provider puts on every container it creates. A
// container is ours only if managed-by, site and node all match; anything
// else is never stopped or removed. The keys and their values are read back
// from containers a previous agent created: they never change meaning.
const (
	LabelPrefix    = "io.infermesh."
	LabelManagedBy = LabelPrefix + "managed-by"
	LabelSite      = LabelPrefix + "site"
	LabelNode      = LabelPrefix + "node" // the agent's node name: the host it runs on
	LabelRole      = LabelPrefix + "role"
	LabelRun       = LabelPrefix + "run" // ProvisionSpec.RunID
	LabelAttempt   = LabelPrefix + "attempt"
	// LabelTarget is the execution target a container is attributed to:
	// the node that created it (cleanup scopes select by it).
	LabelTarget   = LabelPrefix + "target"
	LabelSpecHash = LabelPrefix + "spec-hash"

	// ManagedByValue is the value of LabelManagedBy.
	ManagedByValue = "infermesh"

	// LegacyTargetDocker is what LabelTarget held before it named the node:
	// the runtime. Containers created then still carry it, with LabelNode
	// naming their node; such a container is attributed to its LabelNode
	// (TargetOf). A node may itself be named "docker": its containers carry
	// both labels equal, which reads the same either way.
	LegacyTargetDocker = "docker"
)

// DockerAPI is the part of the Docker Engine API the provider uses;
// *client.Client satisfies it. Eight calls rather than STYLE's 3–6: logs and
// wait are the observation stream, list is the label sweep, and the rest is
// the lifecycle. Implementations must be safe for concurrent use.
type DockerAPI interface {
	ContainerCreate(ctx context.Context, config *container.Config, hostConfig *container.HostConfig, networkingConfig *network.NetworkingConfig, platform *ocispec.Platform, containerName string) (container.CreateResponse, error)
	ContainerStart(ctx context.Context, container string, options container.StartOptions) error
	ContainerStop(ctx context.Context, container string, options container.StopOptions) error
	ContainerRemove(ctx context.Context, container string, options container.RemoveOptions) error
	ContainerInspect(ctx context.Context, container string) (container.InspectResponse, error)
	ContainerList(ctx context.Context, options container.ListOptions) ([]container.Summary, error)
	ContainerLogs(ctx context.Context, container string, options container.LogsOptions) (io.ReadCloser, error)
	ContainerWait(ctx context.Context, container string, condition container.WaitCondition) (<-chan container.WaitResponse, <-chan error)
}

var _ DockerAPI = (*client.Client)(nil)

// Errors callers act on.
var (
	// ErrDaemonUnreachable wraps failures to reach the Docker daemon. It is
	// transient from the caller's view: retry with backoff.
	ErrDaemonUnreachable = errors.New("docker daemon unreachable")
	// ErrNotOwned is returned when a container at an address we derived
	// does not carry our ownership labels; it is never touched.
	ErrNotOwned = errors.New("container not owned by this agent")
	// ErrConfig marks a failure that retrying cannot fix: the spec names
	// something this host does not have (a bind-mount source, an image
	// that cannot be pulled, a native command). The Manager gives the
	// instance up at once (StateFailed) instead of retrying.
	ErrConfig = errors.New("configuration error")
	// ErrMountSource is returned when a bind-mount source does not exist;
	// it is an ErrConfig.
	ErrMountSource = fmt.Errorf("%w: bind-mount source does not exist", ErrConfig)
	// ErrImageNotFound is returned when the image is neither on the host
	// nor pullable; it is an ErrConfig.
	ErrImageNotFound = fmt.Errorf("%w: image not found", ErrConfig)
	// ErrUnknownHandle is returned for a handle the provider did not create,
	// adopt or prepare (or already stopped).
	ErrUnknownHandle = errors.New("unknown instance handle")
)

// DockerConfig configures a DockerProvider. Zero values mean the default.
type DockerConfig struct {
	// Site and Node (this agent's node name) scope ownership: they go into
	// every container's name and labels, and only containers with both are
	// ever listed or removed. Required; token characters [A-Za-z0-9._-].
	Site string
	Node string
	// StopTimeout is the grace period between SIGTERM and SIGKILL. Default 10s.
	StopTimeout time.Duration
	// CallTimeout bounds each non-streaming API call. Default 30s.
	CallTimeout time.Duration
	// LogTail is how many past lines are replayed when adopting a running
	// container. Default 100.
	LogTail int
	// Logger; nil means zap.NewNop().
	Logger *zap.Logger
}

// DefaultDockerConfig returns the defaults (Site and Node still required).
func DefaultDockerConfig() DockerConfig {
	return DockerConfig{
		StopTimeout: 10 * time.Second,
		CallTimeout: 30 * time.Second,
		LogTail:     100,
	}
}

func (c *DockerConfig) fill() error {
	d := DefaultDockerConfig()
	if err := validToken(c.Site); err != nil {
		return fmt.Errorf("docker config: Site: %w", err)
	}
	if err := validToken(c.Node); err != nil {
		return fmt.Errorf("docker config: Node: %w", err)
	}
	defaults.Positive(&c.StopTimeout, d.StopTimeout)
	defaults.Positive(&c.CallTimeout, d.CallTimeout)
	defaults.Positive(&c.LogTail, d.LogTail)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return nil
}

func validToken(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	if len(s) > 64 {
		return fmt.Errorf("%q longer than 64", s)
	}
	for _, r := range s {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
		if !ok {
			return fmt.Errorf("%q has a character outside [A-Za-z0-9._-]", s)
		}
	}
	return nil
}

// DockerProvider implements Provider over a Docker engine: an instance is a
// container. Safe for concurrent use; calls for one instance must be
// serialized by the caller.
//
// Observations: the container's stdout and stderr lines, the provider's
// own lines, and the end of each run: ObsExited with the exit status, or
// ObsFailed when the engine reports the run was killed for running out of
// memory (State.OOMKilled) or the container vanished while watched.
// It produces no ObsTelemetry: the engine's only per-container numbers are
// its stats stream, which would hold one more connection per container
// open for figures nothing in infermesh reads (the agent's metrics are its
// own, on /metrics). A runtime with structured frames to report sends them.
type DockerProvider struct {
	ProviderDefaults

	api DockerAPI
	cfg DockerConfig
	log *zap.Logger

	mu        sync.Mutex
	instances map[string]*dockerInstance // by ref
	closed    bool
	wg        sync.WaitGroup // watcher goroutines
}

// dockerInstance is the provider-local state of one container we manage.
type dockerInstance struct {
	spec ProvisionSpec
	sink Sink
	id   string // container id

	// The watch of the current container run (logs + exit), keyed by its
	// StartedAt so a run is watched once.
	runKey string
	cancel context.CancelFunc
}

// A Docker engine has no offers (no OfferSelector): CreateSelected
// refuses any exact offer for it.
var (
	_ Provider        = (*DockerProvider)(nil)
	_ RefLister       = (*DockerProvider)(nil)
	_ InstanceStopper = (*DockerProvider)(nil)
)

// NewDockerProvider returns a provider over api. Close stops its watchers;
// the caller closes api.
func NewDockerProvider(api DockerAPI, cfg DockerConfig) (*DockerProvider, error) {
	if api == nil {
		return nil, errors.New("docker provider: api is nil")
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	return &DockerProvider{api: api, cfg: cfg, log: cfg.Logger, instances: make(map[string]*dockerInstance)}, nil
}

// Close stops every log and exit watcher and waits for them. Containers are
// left as they are (a restarted agent adopts them). Idempotent.
func (p *DockerProvider) Close() error {
	p.mu.Lock()
	p.closed = true
	for _, n := range p.instances {
		if n.cancel != nil {
			n.cancel()
			n.cancel = nil
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

// Config returns the provider's effective configuration.
func (p *DockerProvider) Config() DockerConfig { return p.cfg }

// ProviderRef returns the container name for spec:
// infermesh-<site>-<node>-<role>-<attempt>, or with r<run>i<instance> in
// place of the role for specs without one. It needs no provider state.
func (p *DockerProvider) ProviderRef(spec ProvisionSpec) string {
	return resourceName(p.cfg.Site, p.cfg.Node, spec)
}

// resourceName is the name of an instance attempt's resource, whatever
// its runtime.
func resourceName(site, node string, spec ProvisionSpec) string {
	who := spec.Role
	if who == "" {
		who = fmt.Sprintf("r%di%d", spec.RunID, spec.InstanceID)
	}
	return fmt.Sprintf("infermesh-%s-%s-%s-%d", site, node, who, spec.AttemptID)
}

func (p *DockerProvider) labels(spec ProvisionSpec) map[string]string {
	return map[string]string{
		LabelManagedBy: ManagedByValue,
		LabelSite:      p.cfg.Site,
		LabelNode:      p.cfg.Node,
		LabelRole:      spec.Role,
		LabelRun:       strconv.FormatUint(spec.RunID, 10),
		LabelAttempt:   strconv.FormatUint(spec.AttemptID, 10),
		LabelTarget:    p.cfg.Node,
		LabelSpecHash:  spec.Hash(),
	}
}

// owned reports whether labels mark a container as this agent's: managed by
// infermesh, this site, this node. Everything else fails closed.
func (p *DockerProvider) owned(labels map[string]string) bool {
	return labels[LabelManagedBy] == ManagedByValue &&
		labels[LabelSite] == p.cfg.Site &&
		labels[LabelNode] == p.cfg.Node
}

func (p *DockerProvider) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, p.cfg.CallTimeout)
}

// wrap adds context to a Docker error and marks daemon connectivity
// failures with ErrDaemonUnreachable, once: an error the client already
// marked (its version negotiation) says so itself.
func wrap(op, ref string, err error) error {
	if client.IsErrConnectionFailed(err) && !errors.Is(err, ErrDaemonUnreachable) {
		return fmt.Errorf("%s %s: %w: %w", op, ref, ErrDaemonUnreachable, err)
	}
	return fmt.Errorf("%s %s: %w", op, ref, err)
}

func (p *DockerProvider) buildConfig(spec ProvisionSpec) (*container.Config, *container.HostConfig) {
	env := make([]string, 0, len(spec.Env))
	for _, e := range spec.Env {
		env = append(env, e.Name+"="+e.Value)
	}
	cc := &container.Config{
		Image:  spec.Image,
		Env:    env,
		Labels: p.labels(spec),
	}
	if len(spec.Args) > 0 {
		cc.Cmd = append([]string(nil), spec.Args...)
	}
	hc := &container.HostConfig{
		RestartPolicy: container.RestartPolicy{Name: container.RestartPolicyDisabled},
		// json-file so the logs API works whatever the daemon default is,
		// rotated so a chatty engine cannot fill the disk.
		LogConfig: container.LogConfig{Type: "json-file", Config: map[string]string{"max-size": "10m", "max-file": "2"}},
	}
	if len(spec.Ports) > 0 {
		cc.ExposedPorts = nat.PortSet{}
		hc.PortBindings = nat.PortMap{}
		for _, port := range spec.Ports {
			cp := nat.Port(fmt.Sprintf("%d/tcp", port))
			cc.ExposedPorts[cp] = struct{}{}
			// Loopback only; the host port is picked by the engine.
			hc.PortBindings[cp] = []nat.PortBinding{{HostIP: "127.0.0.1", HostPort: ""}}
		}
	}
	// Validate has checked the resources: apply cannot fail here.
	_ = spec.Resources.apply(hc)
	for _, m := range spec.Mounts {
		hc.Mounts = append(hc.Mounts, mount.Mount{
			Type:     mount.TypeBind,
			Source:   m.HostPath,
			Target:   m.ContainerPath,
			ReadOnly: m.ReadOnly,
		})
	}
	return cc, hc
}

func checkMounts(spec ProvisionSpec) error {
	for _, m := range spec.Mounts {
		if _, err := os.Stat(m.HostPath); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrMountSource, m.HostPath, err)
		}
	}
	return nil
}

// CreateInstance creates the container for spec (not started: StartInstance
// starts it). It is idempotent: if a container already has the name and
// carries our labels, it is adopted when its spec hash matches and it runs,
// else it is removed and created again. A same-named container without our
// labels is never touched (ErrNotOwned).
func (p *DockerProvider) CreateInstance(ctx context.Context, spec ProvisionSpec, sink Sink) (InstanceHandle, error) {
	if err := spec.Validate(); err != nil {
		return InstanceHandle{}, fmt.Errorf("create instance: %w", err)
	}
	if err := checkMounts(spec); err != nil {
		return InstanceHandle{}, fmt.Errorf("create instance: %w", err)
	}
	if sink == nil {
		sink = Discard
	}
	ref := p.ProviderRef(spec)
	cc, hc := p.buildConfig(spec)

	for try := 0; ; try++ {
		// The engine goes on creating a container after its client gave
		// up, so a create cancelled by the agent's stop would leave one
		// nobody recorded. It is short: let it finish (within the call
		// timeout) and be registered, so it is adopted or replaced next
		// time and a site cleanup that follows the stop finds it.
		cctx, cancel := p.callCtx(context.WithoutCancel(ctx))
		resp, err := p.api.ContainerCreate(cctx, cc, hc, nil, nil, ref)
		cancel()
		if err == nil {
			for _, w := range resp.Warnings {
				p.emit(sink, spec, ref, ObsProvider, "docker: "+w)
			}
			p.register(ref, spec, sink, resp.ID)
			return InstanceHandle{InstanceID: spec.InstanceID, RunID: spec.RunID, Ref: ref, ResourceID: resp.ID}, nil
		}
		if cerrdefs.IsNotFound(err) {
			// EnsureImage pulls before create; an image still missing
			// (removed meanwhile, or no puller) is the operator's to fix.
			return InstanceHandle{}, imageNotFound(spec.Image, err)
		}
		if !cerrdefs.IsConflict(err) || try > 0 {
			return InstanceHandle{}, wrap("create container", ref, err)
		}
		// Name conflict: adopt the existing container or replace it.
		info, err := p.inspect(ctx, ref)
		if err != nil {
			if cerrdefs.IsNotFound(err) {
				continue // removed meanwhile: create again
			}
			return InstanceHandle{}, err
		}
		if info.Config == nil || !p.owned(info.Config.Labels) {
			return InstanceHandle{}, fmt.Errorf("create container %s: name taken: %w", ref, ErrNotOwned)
		}
		if info.Config.Labels[LabelSpecHash] == spec.Hash() && info.State != nil && info.State.Running {
			h := p.register(ref, spec, sink, info.ID)
			p.emit(sink, spec, ref, ObsProvider, "adopted running container "+shortID(info.ID))
			p.watch(ref, info, logsSince(info.State))
			return h, nil
		}
		p.emit(sink, spec, ref, ObsProvider, "replacing stale container "+shortID(info.ID))
		if err := p.removeID(ctx, ref, info.ID); err != nil {
			return InstanceHandle{}, err
		}
	}
}

func (p *DockerProvider) register(ref string, spec ProvisionSpec, sink Sink, id string) InstanceHandle {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.instances[ref]
	if n == nil || n.id != id {
		if n != nil && n.cancel != nil {
			n.cancel()
		}
		n = &dockerInstance{}
		p.instances[ref] = n
	}
	n.spec, n.sink, n.id = spec.Clone(), sink, id
	return InstanceHandle{InstanceID: spec.InstanceID, RunID: spec.RunID, Ref: ref, ResourceID: id}
}

func (p *DockerProvider) instance(ref string) (*dockerInstance, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n, ok := p.instances[ref]
	return n, ok
}

func (p *DockerProvider) forget(ref string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n, ok := p.instances[ref]; ok {
		if n.cancel != nil {
			n.cancel()
		}
		delete(p.instances, ref)
	}
}

// StartInstance starts the container (a no-op if it runs) and begins
// streaming its logs and watching for its exit.
func (p *DockerProvider) StartInstance(ctx context.Context, h InstanceHandle) error {
	n, ok := p.instance(h.Ref)
	if !ok {
		return fmt.Errorf("start %s: %w", h.Ref, ErrUnknownHandle)
	}
	// Where this run's logs begin is only knowable before it starts.
	pre, err := p.inspect(ctx, n.id)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			p.forget(h.Ref)
			return fmt.Errorf("start %s: %w: %w", h.Ref, ErrNotFound, err)
		}
		return err
	}
	// Stopped: FinishedAt ends the previous run. Running already: the
	// same holds for the current run.
	since := ""
	if pre.State != nil {
		since = logsSince(pre.State)
	}
	cctx, cancel := p.callCtx(ctx)
	err = p.api.ContainerStart(cctx, n.id, container.StartOptions{})
	cancel()
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			p.forget(h.Ref)
			return fmt.Errorf("start %s: %w: %w", h.Ref, ErrNotFound, err)
		}
		return wrap("start container", h.Ref, err)
	}
	info, err := p.inspect(ctx, n.id)
	if err != nil {
		return err
	}
	p.watch(h.Ref, info, since)
	return nil
}

// HaltInstance stops the container, keeping it (StartInstance resumes).
func (p *DockerProvider) HaltInstance(ctx context.Context, h InstanceHandle) error {
	n, ok := p.instance(h.Ref)
	if !ok {
		return nil
	}
	return p.stopID(ctx, h.Ref, n.id)
}

// MarkLive has nothing to do for a container: it is live once it
// runs; readiness is the caller's probe.
func (p *DockerProvider) MarkLive(ctx context.Context, h InstanceHandle) error {
	if _, ok := p.instance(h.Ref); !ok {
		return fmt.Errorf("complete %s: %w", h.Ref, ErrUnknownHandle)
	}
	return nil
}

// StopInstance stops and removes the handle's container after re-checking its
// labels. A container already gone is success.
func (p *DockerProvider) StopInstance(ctx context.Context, h InstanceHandle) error {
	id := h.ResourceID
	if n, ok := p.instance(h.Ref); ok {
		id = n.id
	}
	if id == "" {
		id = h.Ref
	}
	p.forget(h.Ref)
	return p.removeOwned(ctx, h.Ref, id)
}

// AdoptBySpec adopts spec's container if it exists, is ours, has spec's
// hash and is running: its logs (the last LogTail lines of the current
// run, then new ones) and exit go to sink. A stopped or stale container is
// not adopted (ok false); CreateInstance replaces it, PrepareBySpec
// picks up a created-but-unstarted one.
func (p *DockerProvider) AdoptBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	info, ok, err := p.lookup(ctx, spec)
	if err != nil || !ok || info.State == nil || !info.State.Running {
		return AdoptedInstance{}, false, err
	}
	if sink == nil {
		sink = Discard
	}
	ref := p.ProviderRef(spec)
	h := p.register(ref, spec, sink, info.ID)
	h.ProcessID = uint32(max(info.State.Pid, 0))
	p.emit(sink, spec, ref, ObsProvider, "adopted running container "+shortID(info.ID))
	p.watch(ref, info, logsSince(info.State))
	return AdoptedInstance{Handle: h, Ref: ref, Running: true}, true, nil
}

// PrepareBySpec registers the handle of spec's existing container
// (ours, same hash, in any state) without starting anything. It never
// creates a container: ok is false when there is none to prepare.
func (p *DockerProvider) PrepareBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	info, ok, err := p.lookup(ctx, spec)
	if err != nil || !ok {
		return AdoptedInstance{}, false, err
	}
	if sink == nil {
		sink = Discard
	}
	ref := p.ProviderRef(spec)
	h := p.register(ref, spec, sink, info.ID)
	running := info.State != nil && info.State.Running
	if running {
		p.watch(ref, info, logsSince(info.State))
	}
	return AdoptedInstance{Handle: h, Ref: ref, Running: running}, true, nil
}

// lookup inspects spec's container; ok is false when there is none or its
// spec hash differs. A container at our name without our labels is an
// error (ErrNotOwned), never "not found".
func (p *DockerProvider) lookup(ctx context.Context, spec ProvisionSpec) (container.InspectResponse, bool, error) {
	ref := p.ProviderRef(spec)
	info, err := p.inspect(ctx, ref)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return container.InspectResponse{}, false, nil
		}
		return container.InspectResponse{}, false, err
	}
	if info.Config == nil || !p.owned(info.Config.Labels) {
		return container.InspectResponse{}, false, fmt.Errorf("lookup %s: %w", ref, ErrNotOwned)
	}
	if info.Config.Labels[LabelSpecHash] != spec.Hash() {
		return container.InspectResponse{}, false, nil
	}
	return info, true, nil
}

// StopBySpec stops and removes spec's container if it is ours, whatever its
// spec hash. It returns false when no such container exists.
func (p *DockerProvider) StopBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (bool, error) {
	ref := p.ProviderRef(spec)
	p.forget(ref)
	info, err := p.inspect(ctx, ref)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return false, nil
		}
		return false, err
	}
	if info.Config == nil || !p.owned(info.Config.Labels) {
		return false, fmt.Errorf("stop %s: %w", ref, ErrNotOwned)
	}
	if err := p.removeID(ctx, ref, info.ID); err != nil {
		return false, err
	}
	if sink != nil {
		p.emit(sink, spec, ref, ObsProvider, "removed container "+shortID(info.ID))
	}
	return true, nil
}

func (p *DockerProvider) inspect(ctx context.Context, ref string) (container.InspectResponse, error) {
	cctx, cancel := p.callCtx(ctx)
	defer cancel()
	info, err := p.api.ContainerInspect(cctx, ref)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return info, err
		}
		return info, wrap("inspect container", ref, err)
	}
	return info, nil
}

// removeOwned inspects id, refuses unless the labels are ours, then stops
// and removes it. Not found is success.
func (p *DockerProvider) removeOwned(ctx context.Context, ref, id string) error {
	info, err := p.inspect(ctx, id)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	if info.Config == nil || !p.owned(info.Config.Labels) {
		return fmt.Errorf("remove %s: %w", ref, ErrNotOwned)
	}
	return p.removeID(ctx, ref, info.ID)
}

// stopID stops a container gracefully (StopTimeout, then SIGKILL).
func (p *DockerProvider) stopID(ctx context.Context, ref, id string) error {
	return stopContainer(ctx, p.api, ref, id, p.cfg.CallTimeout, p.cfg.StopTimeout)
}

// removeID stops (gracefully) then removes a container we already checked.
func (p *DockerProvider) removeID(ctx context.Context, ref, id string) error {
	return stopAndRemove(ctx, p.api, ref, id, p.cfg.CallTimeout, p.cfg.StopTimeout)
}

// stopContainer stops id gracefully: SIGTERM, then SIGKILL after stop.
// Gone is success.
func stopContainer(ctx context.Context, api DockerAPI, ref, id string, call, stop time.Duration) error {
	secs := int(stop.Round(time.Second) / time.Second)
	cctx, cancel := context.WithTimeout(ctx, call+stop)
	defer cancel()
	if err := api.ContainerStop(cctx, id, container.StopOptions{Timeout: &secs}); err != nil && !cerrdefs.IsNotFound(err) {
		return wrap("stop container", ref, err)
	}
	return nil
}

// stopAndRemove stops id gracefully, then removes it. Gone is success.
// The caller has checked its labels.
func stopAndRemove(ctx context.Context, api DockerAPI, ref, id string, call, stop time.Duration) error {
	if err := stopContainer(ctx, api, ref, id, call, stop); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, call)
	defer cancel()
	err := api.ContainerRemove(cctx, id, container.RemoveOptions{Force: true})
	if err != nil && !cerrdefs.IsNotFound(err) {
		return wrap("remove container", ref, err)
	}
	return nil
}

func (p *DockerProvider) emit(sink Sink, spec ProvisionSpec, ref string, kind ObservationKind, line string) {
	o := Observation{Kind: kind, RunID: spec.RunID, InstanceID: spec.InstanceID, Ref: ref, Time: time.Now()}
	switch kind {
	case ObsFailed:
		o.Reason = line
	default:
		o.Line = line
	}
	sink.Observe(o)
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func itoa(n int) string { return strconv.Itoa(n) }
