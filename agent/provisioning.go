package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/store"
)

// This file connects the config's managed instances to provisioning
// (package provision): instance specs from roles, the instance manager of
// the Docker and native runtimes over the state store's intents bucket
// (store.ProvisionIntents), and its orphan sweep (package cleanup).

// desiredInstances maps the config's managed roles (docker and native; a
// simulated instance is served inside the agent) to instance specs.
func (c *Config) desiredInstances() map[string]provision.InstanceSpec {
	out := map[string]provision.InstanceSpec{}
	for name, r := range c.Roles {
		in := r.Instance
		if in == nil || in.Runtime == provision.RuntimeSimulated {
			continue
		}
		mounts := make([]provision.Mount, 0, len(in.Mounts))
		for _, m := range in.Mounts {
			mounts = append(mounts, provision.Mount{HostPath: m.Host, ContainerPath: m.Container, ReadOnly: m.ReadOnly})
		}
		var res *provision.Resources
		if in.GPUs != "" || in.ShmSize != 0 || in.Memory != 0 || in.CPUs != 0 {
			res = &provision.Resources{GPUs: string(in.GPUs), ShmSize: int64(in.ShmSize), Memory: int64(in.Memory), NanoCPUs: int64(in.CPUs * 1e9)}
		}
		out[name] = provision.InstanceSpec{
			Image:   in.Image,
			Command: in.Command,
			Args:    append([]string(nil), in.Args...),
			Env:     in.Env,
			Port:    in.Port,
			Mounts:  mounts,
			Health:  in.Health,
			Model:   r.Model,
			Runtime: in.Runtime,
			Restart: provision.RestartPolicy{Max: in.Restart.Max, Window: in.Restart.Window, Backoff: in.Restart.Backoff},

			Resources:    res,
			StartTimeout: in.StartupTimeout,
		}
	}
	return out
}

// boundKinds is the set of runtime binding kinds the roles' instances use.
func (c *Config) boundKinds() cleanup.KindSet {
	var ks cleanup.KindSet
	for _, r := range c.Roles {
		if r.Instance != nil {
			ks.Add(cleanup.Kind(r.Instance.Runtime))
		}
	}
	return ks
}

// layout is where the site keeps things on this host.
func (c *Config) layout() (cleanup.Layout, error) {
	state, err := filepath.Abs(c.Node.StateDir)
	if err != nil {
		return cleanup.Layout{}, fmt.Errorf("node.state_dir: %w", err)
	}
	l := cleanup.Layout{StateDir: state, CacheRoot: c.Node.CacheDir, Site: c.Site}
	return l, l.Validate()
}

// provisioning is the running instance manager, its orphan sweep and what
// they own.
type provisioning struct {
	mgr     *provision.Manager
	sweeper *cleanup.Sweeper
	docker  *provision.DockerProvider
	native  *provision.NativeProvider
	cli     *provision.DockerClient
}

// startProvisioning builds the instance manager (Docker and native
// runtimes) and its orphan sweep when the config has managed instances or
// the store remembers some (a role removed from the config still has a
// resource to remove). It returns nil, nil when there is nothing to manage.
// The Docker daemon need not be reachable: the manager retries with backoff
// and other roles keep serving.
func (a *Agent) startProvisioning(ctx context.Context, st *store.Store) (*provisioning, error) {
	intents, err := provision.NewBoltIntents(st)
	if err != nil {
		return nil, err
	}
	desired := a.config().desiredInstances()
	remembered, err := intents.Intents()
	if err != nil {
		return nil, err
	}
	if len(desired) == 0 && len(remembered) == 0 {
		return nil, nil
	}
	layout, err := a.config().layout()
	if err != nil {
		return nil, err
	}
	node := a.config().Node.Name
	p := &provisioning{}
	ok := false
	defer func() {
		if !ok {
			p.close()
		}
	}()
	if p.cli, err = provision.NewDockerClient(); err != nil {
		return nil, err
	}
	if p.docker, err = provision.NewDockerProvider(p.cli, provision.DockerConfig{Site: a.config().Site, Node: node, Logger: a.log.Named("docker")}); err != nil {
		return nil, err
	}
	p.native, err = provision.NewNativeProvider(provision.NativeConfig{
		Site: a.config().Site, Node: node, Dir: layout.NodeDir(node), CacheDir: layout.NodeCache(node),
		Logger: a.log.Named("native"),
	})
	if err != nil {
		return nil, err
	}
	mcfg := provision.ManagerConfig{
		Providers: map[string]provision.InstanceProvider{
			provision.RuntimeDocker: p.docker,
			provision.RuntimeNative: p.native,
		},
		Intents:   intents,
		Registrar: a.table,
		Logger:    a.log.Named("provision"),
		Events: func(e provision.Event) {
			a.audit.Record(Event{Kind: "provision." + e.Kind.String(), Role: e.Role, Fields: map[string]string{"message": e.Message, "ref": e.Ref}})
		},
		// The same keys the proxy sends (upstream_api_key_file).
		ProbeKey: a.upstreamKey,
	}
	if a.opts.ProvisionTuning != nil {
		a.opts.ProvisionTuning(&mcfg)
	}
	if p.mgr, err = provision.NewManager(mcfg); err != nil {
		return nil, err
	}
	a.metrics.SetInstances(instanceStats{p.mgr})
	if err := p.mgr.Apply(ctx, desired); err != nil {
		return nil, fmt.Errorf("roles: %w", err)
	}

	// The orphan sweep is a site cleanup of this node's execution target
	// through the same code as `infermesh site cleanup`.
	backends, err := provision.NewSiteCleanups(provision.SiteCleanupsConfig{Docker: p.cli, Layout: layout, Node: node, Logger: a.log.Named("cleanup")})
	if err != nil {
		return nil, err
	}
	sc, err := backends.SiteCleanup(a.config().boundKinds())
	if err != nil {
		return nil, err
	}
	scfg := cleanup.SweeperConfig{
		Cleanup: sc, Site: a.config().Site, Node: node, Wanted: p.mgr.Wanted, Logger: a.log.Named("sweep"),
		OnSweep: func(rep cleanup.Report, _ error) {
			for _, r := range rep.Removed {
				a.audit.Record(Event{Kind: "cleanup.orphan_removed", Role: r.Role, Fields: map[string]string{"runtime": r.Runtime, "ref": r.Ref, "resource": r.Description}})
			}
		},
	}
	if a.opts.SweepTuning != nil {
		a.opts.SweepTuning(&scfg)
	}
	if p.sweeper, err = cleanup.NewSweeper(scfg); err != nil {
		return nil, err
	}
	a.log.Info("provisioning managed instances", zap.Int("roles", len(desired)), zap.Int("remembered", len(remembered)))
	ok = true
	return p, nil
}

// close stops following instances (they keep running) and closes the
// Docker client. Safe on a partly built provisioning.
func (p *provisioning) close() {
	if p.docker != nil {
		_ = p.docker.Close()
	}
	if p.native != nil {
		_ = p.native.Close()
	}
	if p.cli != nil {
		_ = p.cli.Close()
	}
}

// lateInstances lets the admin backend be built before the instance manager
// (which needs the backend's state store).
type lateInstances struct {
	m atomic.Pointer[provision.Manager]
}

var _ InstanceAPI = (*lateInstances)(nil)

func (l *lateInstances) Instances() []provision.InstanceStatus {
	if m := l.m.Load(); m != nil {
		return m.Instances()
	}
	return nil
}

func (l *lateInstances) Instance(role string) (provision.InstanceStatus, bool) {
	if m := l.m.Load(); m != nil {
		return m.Instance(role)
	}
	return provision.InstanceStatus{}, false
}

func (l *lateInstances) Retry(role string) error {
	if m := l.m.Load(); m != nil {
		return m.Retry(role)
	}
	return fmt.Errorf("role %q: %w", role, provision.ErrNoInstance)
}

func (l *lateInstances) Stop(ctx context.Context, role string) error {
	if m := l.m.Load(); m != nil {
		return m.Stop(ctx, role)
	}
	return fmt.Errorf("role %q: %w", role, provision.ErrNoInstance)
}

func (l *lateInstances) Logs(role string, n int) []provision.LogLine {
	if m := l.m.Load(); m != nil {
		return m.Logs(role, n)
	}
	return nil
}

func (l *lateInstances) FollowLogs(ctx context.Context, role string, n int, fn func(provision.LogLine) error) error {
	if m := l.m.Load(); m != nil {
		return m.FollowLogs(ctx, role, n, fn)
	}
	return fmt.Errorf("role %q: %w", role, provision.ErrNoInstance)
}

// instanceStats adapts the instance manager to the metrics.
type instanceStats struct{ m *provision.Manager }

func (s instanceStats) InstanceStats() []metrics.InstanceStat {
	list := s.m.Instances()
	out := make([]metrics.InstanceStat, 0, len(list))
	for _, i := range list {
		out = append(out, metrics.InstanceStat{Role: i.Role, State: string(i.State), Restarts: i.Restarts})
	}
	return out
}

// stopWithAgent stops the instances of the roles configured with
// stop_with_agent, once the manager (done) has ended: instances outlive the
// agent otherwise, and the next agent adopts them.
func (a *Agent) stopWithAgent(m *provision.Manager, done <-chan struct{}) {
	cfg := a.config() // what the last reload put in force
	var roles []string
	for _, name := range sortedKeys(cfg.Roles) {
		if in := cfg.Roles[name].Instance; in != nil && in.StopWithAgent {
			roles = append(roles, name)
		}
	}
	if len(roles) == 0 {
		return
	}
	<-done
	ctx, cancel := context.WithTimeout(context.Background(), stopWithAgentTimeout)
	defer cancel()
	if err := m.Halt(ctx, roles...); err != nil {
		a.log.Error("stopping instances with the agent", zap.Strings("roles", roles), zap.Error(err))
		return
	}
	a.log.Info("stopped instances with the agent (stop_with_agent)", zap.Strings("roles", roles))
}

// stopWithAgentTimeout bounds stopping instances at shutdown; within the
// unit's TimeoutStopSec with the proxy's drain.
const stopWithAgentTimeout = 10 * time.Second
