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
