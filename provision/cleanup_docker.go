package provision

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/identity"
)

// DockerRuntimeName is the Docker runtime's name in cleanup reports.
const DockerRuntimeName = "Docker runtime"

// Errors of TargetOf.
var (
	errTargetMissing   = errors.New("no execution-target label")
	errTargetMalformed = errors.New("malformed execution-target label")
)

// TargetOf is the execution target (node) a container's labels attribute it
// to: LabelTarget, or for a container created before that label named the
// node (it holds LegacyTargetDocker), its LabelNode. A missing or malformed
// label is an error naming which.
func TargetOf(labels map[string]string) (target string, legacy bool, err error) {
	t, ok := labels[LabelTarget]
	if !ok || t == "" {
		return "", false, errTargetMissing
	}
	if t == LegacyTargetDocker {
		node := labels[LabelNode]
		if identity.ValidateNodeName(node) != nil {
			return "", false, fmt.Errorf("%w: %q, and node label %q is not a node name", errTargetMalformed, t, node)
		}
		return node, node != t, nil
	}
	if err := identity.ValidateNodeName(t); err != nil {
		return "", false, fmt.Errorf("%w: %w", errTargetMalformed, err)
	}
	return t, false, nil
}

// DockerSiteCleanup is the Docker runtime's part of a site cleanup
// (cleanup.Runtime): the containers on this engine labelled as managed by
// infermesh and with the site, whichever node created them.
type DockerSiteCleanup struct {
	api         DockerAPI
	callTimeout time.Duration
	stopTimeout time.Duration
}

var _ cleanup.Runtime = (*DockerSiteCleanup)(nil)

// NewDockerSiteCleanup returns the Docker runtime's cleanup over api.
// Zero timeouts mean DefaultDockerConfig's.
func NewDockerSiteCleanup(api DockerAPI, callTimeout, stopTimeout time.Duration) *DockerSiteCleanup {
	d := DefaultDockerConfig()
	if callTimeout <= 0 {
		callTimeout = d.CallTimeout
	}
	if stopTimeout <= 0 {
		stopTimeout = d.StopTimeout
	}
	return &DockerSiteCleanup{api: api, callTimeout: callTimeout, stopTimeout: stopTimeout}
}

// Name implements cleanup.Runtime.
func (d *DockerSiteCleanup) Name() string { return DockerRuntimeName }

// unreachable marks a daemon connection failure as cleanup.ErrUnreachable.
// The mark adds no words: the error says "docker daemon unreachable"
// already.
func unreachable(err error) error {
	if errors.Is(err, ErrDaemonUnreachable) {
		return markedError{mark: cleanup.ErrUnreachable, err: err}
	}
	return err
}

// markedError is err, matching mark as well under errors.Is.
type markedError struct{ mark, err error }

func (e markedError) Error() string   { return e.err.Error() }
func (e markedError) Unwrap() []error { return []error{e.mark, e.err} }

// siteContainer reports whether labels are the site's: managed by
// infermesh, with the site label. Everything else is never touched.
func siteContainer(labels map[string]string, site string) bool {
	return labels[LabelManagedBy] == ManagedByValue && labels[LabelSite] == site
}

// Discover implements cleanup.Runtime. The daemon filters by label and
// every result is re-checked here. In a targets scope a site container
// whose target label is missing or malformed fails the whole discovery
// (cleanup.ErrUnattributable); containers of other well-formed targets are
// left out.
func (d *DockerSiteCleanup) Discover(ctx context.Context, site string, scope cleanup.Scope) ([]cleanup.Resource, error) {
	f := filters.NewArgs(
		filters.Arg("label", LabelManagedBy+"="+ManagedByValue),
		filters.Arg("label", LabelSite+"="+site),
	)
	cctx, cancel := context.WithTimeout(ctx, d.callTimeout)
	list, err := d.api.ContainerList(cctx, container.ListOptions{All: true, Filters: f})
	cancel()
	if err != nil {
		return nil, unreachable(wrap("list containers of site", site, err))
	}
	sort.Slice(list, func(i, j int) bool { return containerRef(list[i]) < containerRef(list[j]) })
	var out []cleanup.Resource
	var unattributable []string
	for _, c := range list {
		if !siteContainer(c.Labels, site) {
			continue
		}
		ref := containerRef(c)
		target, legacy, terr := TargetOf(c.Labels)
		if terr != nil && !scope.IsSite() {
			unattributable = append(unattributable, fmt.Sprintf("%s: %v", ref, terr))
			continue
		}
		if terr == nil && !scope.Includes(target) {
			continue // another well-formed target's: left alone
		}
		attempt, _ := strconv.ParseUint(c.Labels[LabelAttempt], 10, 64)
		r := cleanup.Resource{
			Runtime: DockerRuntimeName, Ref: ref, ID: c.ID, Role: c.Labels[LabelRole],
			Target: target, Attempt: attempt, State: string(c.State), Created: time.Unix(c.Created, 0),
		}
		r.Description = describeContainer(r, legacy, terr)
		out = append(out, r)
	}
	if len(unattributable) > 0 {
		return nil, fmt.Errorf("%w: %s", cleanup.ErrUnattributable, strings.Join(unattributable, "; "))
	}
	return out, nil
}

func containerRef(c container.Summary) string {
	if len(c.Names) == 0 {
		return c.ID
	}
	return strings.TrimPrefix(c.Names[0], "/")
}

// describeContainer is the operator's line for a container.
func describeContainer(r cleanup.Resource, legacy bool, terr error) string {
	var b strings.Builder
	fmt.Fprintf(&b, "container %s (%s", r.Ref, shortID(r.ID))
	if r.Role != "" {
		fmt.Fprintf(&b, ", role %s", r.Role)
	}
	switch {
	case terr != nil:
		fmt.Fprintf(&b, ", node unknown: %v", terr)
	case legacy:
		fmt.Fprintf(&b, ", node %s (legacy target label %q)", r.Target, LegacyTargetDocker)
	default:
		fmt.Fprintf(&b, ", node %s", r.Target)
	}
	if r.Attempt > 0 {
		fmt.Fprintf(&b, ", attempt %d", r.Attempt)
	}
	fmt.Fprintf(&b, ", %s)", r.State)
	return b.String()
}

// Remove implements cleanup.Runtime: it inspects the container again and
// refuses (cleanup.ErrRefused) unless it is still the same site container
// of the scope, then stops (gracefully) and removes it. Gone is success.
func (d *DockerSiteCleanup) Remove(ctx context.Context, site string, scope cleanup.Scope, r cleanup.Resource) error {
	cctx, cancel := context.WithTimeout(ctx, d.callTimeout)
	info, err := d.api.ContainerInspect(cctx, r.ID)
	cancel()
	if cerrdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return unreachable(wrap("inspect container", r.Ref, err))
	}
	if info.Config == nil || !siteContainer(info.Config.Labels, site) || strings.TrimPrefix(info.Name, "/") != r.Ref {
		return fmt.Errorf("%w: container %s is no longer labelled as site %s's", cleanup.ErrRefused, r.Ref, site)
	}
	if !scope.IsSite() {
		target, _, err := TargetOf(info.Config.Labels)
		if err != nil || !scope.Includes(target) {
			return fmt.Errorf("%w: container %s is no longer of %s", cleanup.ErrRefused, r.Ref, scope)
		}
	}
	return unreachable(stopAndRemove(ctx, d.api, r.Ref, info.ID, d.callTimeout, d.stopTimeout))
}
