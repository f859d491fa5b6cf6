package provision

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
)

// The Docker provider's inventory: what this agent's containers are and
// what state they are in, beyond the provider contract. The Manager uses it
// (InstanceProvider) for status and the orphan sweep.

// ListManagedRefs lists the names of this site's and node's containers.
func (p *DockerProvider) ListManagedRefs(ctx context.Context) ([]string, error) {
	cs, err := p.ListManaged(ctx)
	if err != nil {
		return nil, err
	}
	refs := make([]string, 0, len(cs))
	for _, c := range cs {
		refs = append(refs, c.Ref)
	}
	return refs, nil
}

// ManagedContainer is one container carrying this agent's labels.
type ManagedContainer struct {
	Ref      string // container name
	ID       string
	Role     string
	Attempt  uint64
	SpecHash string
	State    string // docker state: created, running, exited, ...
	Labels   map[string]string
}

// ListManaged lists containers (any state) labeled with this site and node.
// The daemon filters by label, and every result is re-checked client-side:
// anything not fully ours is left out (fail closed).
func (p *DockerProvider) ListManaged(ctx context.Context) ([]ManagedContainer, error) {
	f := filters.NewArgs(
		filters.Arg("label", LabelManagedBy+"="+ManagedByValue),
		filters.Arg("label", LabelSite+"="+p.cfg.Site),
		filters.Arg("label", LabelNode+"="+p.cfg.Node),
	)
	cctx, cancel := p.callCtx(ctx)
	defer cancel()
	list, err := p.api.ContainerList(cctx, container.ListOptions{All: true, Filters: f})
	if err != nil {
		return nil, wrap("list containers", p.cfg.Site+"/"+p.cfg.Node, err)
	}
	var out []ManagedContainer
	for _, c := range list {
		if !p.owned(c.Labels) || len(c.Names) == 0 {
			continue
		}
		attempt, _ := strconv.ParseUint(c.Labels[LabelAttempt], 10, 64)
		out = append(out, ManagedContainer{
			Ref:      strings.TrimPrefix(c.Names[0], "/"),
			ID:       c.ID,
			Role:     c.Labels[LabelRole],
			Attempt:  attempt,
			SpecHash: c.Labels[LabelSpecHash],
			State:    string(c.State),
			Labels:   c.Labels,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Ref < out[j].Ref })
	return out, nil
}

// RemoveManaged stops and removes the container ref after re-checking that
// it carries our labels (ErrNotOwned otherwise). Gone already is success.
func (p *DockerProvider) RemoveManaged(ctx context.Context, ref string) error {
	p.forget(ref)
	return p.removeOwned(ctx, ref, ref)
}

// Status inspects ref's container (ErrNotFound when it does not exist,
// ErrNotOwned when it is not ours).
func (p *DockerProvider) Status(ctx context.Context, ref string) (ResourceStatus, error) {
	info, err := p.inspect(ctx, ref)
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, ErrNotFound)
		}
		return ResourceStatus{}, err
	}
	if info.Config == nil || !p.owned(info.Config.Labels) {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, ErrNotOwned)
	}
	st := ResourceStatus{ID: info.ID, Endpoints: map[int]string{}}
	if info.State != nil {
		st.Running = info.State.Running
		st.ExitCode = info.State.ExitCode
		st.Pid = info.State.Pid
		st.StartedAt, _ = time.Parse(time.RFC3339Nano, info.State.StartedAt)
		st.Failure = runFailure(info.State)
	}
	if info.NetworkSettings != nil {
		for port, bindings := range info.NetworkSettings.Ports {
			for _, b := range bindings {
				if b.HostIP == "127.0.0.1" && b.HostPort != "" {
					st.Endpoints[port.Int()] = "127.0.0.1:" + b.HostPort
				}
			}
		}
	}
	return st, nil
}
