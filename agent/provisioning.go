package agent

import (
	"context"
	"fmt"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/provision"
	"go.etcd.io/bbolt"
)

// This file connects the config's managed instances to provisioning
// (package provision): instance specs from roles, and the Docker-backed
// instance manager over the state store's intents bucket.

// intentsBucket is the state-store bucket of provisioning intents.
const intentsBucket = "provision.intents"

// desiredInstances maps the config's managed roles to instance specs.
func (c *Config) desiredInstances() map[string]provision.InstanceSpec {
	out := map[string]provision.InstanceSpec{}
	for name, r := range c.Roles {
		in := r.Instance
		if in == nil {
			continue
		}
		mounts := make([]provision.Mount, 0, len(in.Mounts))
		for _, m := range in.Mounts {
			mounts = append(mounts, provision.Mount{HostPath: m.Host, ContainerPath: m.Container, ReadOnly: m.ReadOnly})
		}
		out[name] = provision.InstanceSpec{
			Image:   in.Image,
			Args:    append([]string(nil), in.Args...),
			Env:     in.Env,
			Port:    in.Port,
			Mounts:  mounts,
			Health:  in.Health,
			Model:   r.Model,
			Runtime: in.Runtime,
			Restart: provision.RestartPolicy{Max: in.Restart.Max, Window: in.Restart.Window, Backoff: in.Restart.Backoff},
		}
	}
	return out
}

// provisioning is the running instance manager and what it owns.
type provisioning struct {
	mgr      *provision.Manager
	provider *provision.DockerProvider
	closeAPI func() error
}

// startProvisioning builds the Docker-backed instance manager when the
// config has managed instances or the store remembers some (a role removed
// from the config still has a container to remove). It returns nil, nil
// when there is nothing to manage. The daemon need not be reachable: the
// manager retries with backoff and other roles keep serving.
func (a *Agent) startProvisioning(ctx context.Context, db *bbolt.DB) (*provisioning, error) {
	intents, err := provision.NewBoltIntents(db, intentsBucket)
	if err != nil {
		return nil, err
	}
	desired := a.cfg.desiredInstances()
	remembered, err := intents.Intents()
	if err != nil {
		return nil, err
	}
	if len(desired) == 0 && len(remembered) == 0 {
		return nil, nil
	}
	cli, err := provision.NewDockerClient()
	if err != nil {
		return nil, err
	}
	prov, err := provision.NewDockerProvider(cli, provision.DockerConfig{Site: a.cfg.Site, Node: a.cfg.Node.Name, Logger: a.log.Named("docker")})
	if err != nil {
		_ = cli.Close()
		return nil, err
	}
	mcfg := provision.ManagerConfig{
		Provider:     prov,
		Intents:      intents,
		Registrar:    a.table,
		Logger:       a.log.Named("provision"),
		SweepOnStart: true,
		Events: func(e provision.Event) {
			a.audit.Record(Event{Kind: "provision." + e.Kind.String(), Role: e.Role, Fields: map[string]string{"message": e.Message, "ref": e.Ref}})
		},
	}
	if a.opts.ProvisionTuning != nil {
		a.opts.ProvisionTuning(&mcfg)
	}
	mgr, err := provision.NewManager(mcfg)
	if err != nil {
		_ = prov.Close()
		_ = cli.Close()
		return nil, err
	}
	if err := mgr.Apply(ctx, desired); err != nil {
		_ = prov.Close()
		_ = cli.Close()
		return nil, fmt.Errorf("roles: %w", err)
	}
	a.log.Info("provisioning managed instances", zap.Int("roles", len(desired)), zap.Int("remembered", len(remembered)))
	return &provisioning{mgr: mgr, provider: prov, closeAPI: cli.Close}, nil
}

func (p *provisioning) close() {
	_ = p.provider.Close()
	_ = p.closeAPI()
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

func (l *lateInstances) Logs(role string, n int) []provision.LogLine {
	if m := l.m.Load(); m != nil {
		return m.Logs(role, n)
	}
	return nil
}
