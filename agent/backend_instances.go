package agent

import (
	"context"
	"errors"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/provision"
)

var errNoProvisioning = admin.Errorf(admin.ErrNotConfigured, "provisioning is not configured on this node (no role has an instance)")

// Instances implements admin.Backend.
func (b *Backend) Instances(context.Context) ([]admin.Instance, error) {
	if b.inst == nil {
		return nil, errNoProvisioning
	}
	list := b.inst.Instances()
	out := make([]admin.Instance, 0, len(list))
	for _, s := range list {
		out = append(out, adminInstance(s))
	}
	return out, nil
}

// RetryInstance implements admin.Backend.
func (b *Backend) RetryInstance(_ context.Context, by admin.Caller, role string) (admin.Instance, error) {
	if b.inst == nil {
		return admin.Instance{}, errNoProvisioning
	}
	switch err := b.inst.Retry(role); {
	case errors.Is(err, provision.ErrNoInstance):
		return admin.Instance{}, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	case errors.Is(err, provision.ErrNotFailed):
		return admin.Instance{}, admin.Errorf(admin.ErrConflict, "%v: it restarts within its policy by itself", err)
	case err != nil:
		return admin.Instance{}, err
	}
	b.a.audit.Record(Event{Kind: AuditAdminRetry, Role: role, Fields: map[string]string{"by": by.String()}})
	s, _ := b.inst.Instance(role)
	s.Role = role
	return adminInstance(s), nil
}

// StopInstance implements admin.Backend.
func (b *Backend) StopInstance(ctx context.Context, by admin.Caller, role string) (admin.Instance, error) {
	if b.inst == nil {
		return admin.Instance{}, errNoProvisioning
	}
	switch err := b.inst.Stop(ctx, role); {
	case errors.Is(err, provision.ErrNoInstance):
		return admin.Instance{}, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	case err != nil:
		return admin.Instance{}, err
	}
	b.a.audit.Record(Event{Kind: AuditAdminStop, Role: role, Fields: map[string]string{"by": by.String()}})
	s, _ := b.inst.Instance(role)
	s.Role = role
	return adminInstance(s), nil
}

// PullInstance implements admin.PullBackend with the Docker provider's
// pull, the one an instance's first start uses.
func (b *Backend) PullInstance(ctx context.Context, by admin.Caller, role string, progress func(string) error) error {
	r, ok := b.cfg.Load().Roles[role]
	if !ok || r.Instance == nil {
		return admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	if rt := r.Instance.Runtime; rt != "" && rt != provision.RuntimeDocker {
		return admin.Errorf(admin.ErrInvalid, "role %q has a %s instance: only a docker instance has an image to pull", role, rt)
	}
	b.a.mu.Lock()
	prov := b.a.prov
	b.a.mu.Unlock()
	if prov == nil || prov.docker == nil {
		return errNoProvisioning
	}
	img := r.Instance.Image
	b.a.audit.Record(Event{Kind: AuditAdminPull, Role: role, Fields: map[string]string{"by": by.String(), "image": img}})
	var werr error
	pulled := false
	sink := provision.SinkFunc(func(o provision.Observation) {
		pulled = true
		if werr == nil {
			werr = progress(o.Line)
		}
	})
	err := prov.docker.EnsureImage(ctx, provision.ProvisionSpec{Image: img}, sink)
	switch {
	case errors.Is(err, provision.ErrImageNotFound):
		return admin.Errorf(admin.ErrNotFound, "%v", err)
	case err != nil:
		return err
	case werr != nil:
		return werr
	case !pulled:
		return progress("image " + img + " is already on this host")
	}
	return nil
}

// adminInstance is the admin API's view of an instance.
func adminInstance(s provision.InstanceStatus) admin.Instance {
	return admin.Instance{
		Role: s.Role, State: string(s.State), Runtime: s.Runtime, Ref: s.Ref, ContainerID: s.ContainerID, PID: s.PID,
		Endpoint: s.Endpoint, Image: s.Image, Restarts: s.Restarts, LastError: s.LastError, Since: s.Since.UTC(),
	}
}

// InstanceLogs implements admin.Backend.
func (b *Backend) InstanceLogs(_ context.Context, role string, n int) ([]admin.LogLine, error) {
	if b.inst == nil {
		return nil, errNoProvisioning
	}
	if _, ok := b.inst.Instance(role); !ok {
		return nil, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	lines := b.inst.Logs(role, n)
	out := make([]admin.LogLine, 0, len(lines))
	for _, l := range lines {
		out = append(out, admin.LogLine{Time: l.Time.UTC(), Stream: l.Stream, Line: l.Line})
	}
	return out, nil
}

var _ admin.LogsBackend = (*Backend)(nil)

// FollowInstanceLogs implements admin.LogsBackend.
func (b *Backend) FollowInstanceLogs(ctx context.Context, role string, n int, fn func(admin.LogLine) error) error {
	if b.inst == nil {
		return errNoProvisioning
	}
	err := b.inst.FollowLogs(ctx, role, n, func(l provision.LogLine) error {
		return fn(admin.LogLine{Time: l.Time.UTC(), Stream: l.Stream, Line: l.Line})
	})
	if errors.Is(err, provision.ErrNoInstance) {
		return admin.Errorf(admin.ErrNotFound, "role %q has no managed instance any more", role)
	}
	return err
}
