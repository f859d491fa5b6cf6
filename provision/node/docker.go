package node

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/network"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/crypto/ssh"

	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/provision"
)

// Labels of node containers, besides provision's managed-by, site, run and
// target. LabelNode (provision.LabelNode) and LabelTarget are the node the
// container *is*: a site cleanup attributes it to that node, and an agent's
// orphan sweep (its own node's resources) never lists it. LabelOwner is the
// agent that created it. (Node containers made before the target label
// named the node carry "docker" there; cleanup attributes them to their
// node label alike.)
const (
	LabelOwner = provision.LabelPrefix + "owner"
	LabelKind  = provision.LabelPrefix + "kind"
	// KindNodeValue is LabelKind's value on node containers.
	KindNodeValue = "node"
)

// Environment injected into node containers: who they are and how they
// join (the join credential itself is written over SSH; this is where).
const (
	EnvRun               = "INFERMESH_RUN"
	EnvNode              = "INFERMESH_NODE"
	EnvJoin              = "INFERMESH_JOIN"
	EnvJoinCredentialRef = "INFERMESH_JOIN_CREDENTIAL_REF"
)

// DockerAPI is the part of the Docker client DockerLease uses;
// *provision.DockerClient satisfies it. Safe for concurrent use.
type DockerAPI interface {
	ContainerCreate(ctx context.Context, config *container.Config, hostConfig *container.HostConfig, networkingConfig *network.NetworkingConfig, platform *ocispec.Platform, containerName string) (container.CreateResponse, error)
	CopyToContainer(ctx context.Context, container, path string, content io.Reader, options container.CopyToContainerOptions) error
	ContainerStart(ctx context.Context, container string, options container.StartOptions) error
	ContainerInspect(ctx context.Context, container string) (container.InspectResponse, error)
	ContainerStop(ctx context.Context, container string, options container.StopOptions) error
	ContainerRemove(ctx context.Context, container string, options container.RemoveOptions) error
}

var _ DockerAPI = (*provision.DockerClient)(nil)

// ErrNotOwned: a container at a node's name is not this agent's node
// container; it is never touched.
var ErrNotOwned = provision.ErrNotOwned

// DockerLeaseConfig configures a DockerLease.
type DockerLeaseConfig struct {
	// Site and Owner (this agent's node name) go into every container's
	// name and labels; only containers with both are ever removed.
	Site, Owner string
	// AuthorizedKeys may log in as root: the agent's bootstrap key.
	AuthorizedKeys []ssh.PublicKey
	// CallTimeout bounds each Docker call. Default 30s.
	CallTimeout time.Duration
	// StopTimeout is how long a node container gets to shut down (its
	// agent leaves the mesh) before it is removed by force. Default 10s.
	StopTimeout time.Duration
}

// DockerLease leases node containers from the local Docker engine.
type DockerLease struct {
	api DockerAPI
	cfg DockerLeaseConfig
}

var _ Lease = (*DockerLease)(nil)

// NewDockerLease returns a lease provider over api.
func NewDockerLease(api DockerAPI, cfg DockerLeaseConfig) (*DockerLease, error) {
	if api == nil {
		return nil, errors.New("docker lease: api is nil")
	}
	if err := validName(cfg.Site); err != nil {
		return nil, fmt.Errorf("docker lease: Site: %w", err)
	}
	if err := validName(cfg.Owner); err != nil {
		return nil, fmt.Errorf("docker lease: Owner: %w", err)
	}
	if len(cfg.AuthorizedKeys) == 0 {
		return nil, errors.New("docker lease: no authorized key (nobody could log in)")
	}
	defaults.Positive(&cfg.CallTimeout, 30*time.Second)
	defaults.Positive(&cfg.StopTimeout, 10*time.Second)
	return &DockerLease{api: api, cfg: cfg}, nil
}

// Kind is docker.
func (d *DockerLease) Kind() Kind { return KindDocker }

// ContainerName is the deterministic name of node's container:
// infermesh-<site>-<owner>-node-<node>.
func (d *DockerLease) ContainerName(node string) string {
	return fmt.Sprintf("infermesh-%s-%s-node-%s", d.cfg.Site, d.cfg.Owner, node)
}

func (d *DockerLease) labels(spec Spec) map[string]string {
	return map[string]string{
		provision.LabelManagedBy: provision.ManagedByValue,
		provision.LabelSite:      d.cfg.Site,
		provision.LabelNode:      spec.Name,
		provision.LabelRun:       strconv.FormatUint(spec.Run, 10),
		provision.LabelTarget:    spec.Name,
		LabelOwner:               d.cfg.Owner,
		LabelKind:                KindNodeValue,
	}
}

// owned reports whether labels mark a container as this agent's container
// of node; everything else fails closed.
func (d *DockerLease) owned(labels map[string]string, node string) bool {
	return labels[provision.LabelManagedBy] == provision.ManagedByValue &&
		labels[provision.LabelSite] == d.cfg.Site &&
		labels[LabelOwner] == d.cfg.Owner &&
		labels[LabelKind] == KindNodeValue &&
		labels[provision.LabelNode] == node
}

func (d *DockerLease) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.cfg.CallTimeout)
}

// Create creates the node container, writes a freshly generated SSH host
// key and the agent's authorized key into it, starts it, and returns the
// lease with the host key pinned. The private host key exists only in the
// container.
func (d *DockerLease) Create(ctx context.Context, spec Spec) (LeaseFacts, *Endpoint, error) {
	if spec.Provider != KindDocker || spec.Docker == nil {
		return LeaseFacts{}, nil, fmt.Errorf("docker lease: refusing a %q node spec", spec.Provider)
	}
	_, hostKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return LeaseFacts{}, nil, fmt.Errorf("host key: %w", err)
	}
	hostPub, err := ssh.NewPublicKey(hostKey.Public())
	if err != nil {
		return LeaseFacts{}, nil, fmt.Errorf("host key: %w", err)
	}
	name := d.ContainerName(spec.Name)
	cc, hc := nodeimage.ContainerConfig(spec.Docker.Image)
	cc.Labels = d.labels(spec)
	cc.Hostname = spec.Name
	cc.Env = append(cc.Env,
		EnvRun+"="+strconv.FormatUint(spec.Run, 10),
		EnvNode+"="+spec.Name,
		EnvJoin+"="+strings.Join(spec.Join, ","),
		EnvJoinCredentialRef+"="+spec.JoinCredentialRef,
	)
	var nc *network.NetworkingConfig
	if n := spec.Docker.Network; n != "" {
		hc.NetworkMode = container.NetworkMode(n)
		nc = &network.NetworkingConfig{EndpointsConfig: map[string]*network.EndpointSettings{n: {}}}
	}
	cctx, cancel := d.call(ctx)
	resp, err := d.api.ContainerCreate(cctx, cc, hc, nc, nil, name)
	cancel()
	if err != nil {
		if cerrdefs.IsConflict(err) {
			return LeaseFacts{}, nil, fmt.Errorf("container %s exists already (a node of that name was not removed): %w", name, err)
		}
		return LeaseFacts{}, nil, fmt.Errorf("create container %s: %w", name, err)
	}
	seed, err := nodeimage.SeedFiles(hostKey, d.cfg.AuthorizedKeys)
	if err != nil {
		return LeaseFacts{}, nil, err
	}
	cctx, cancel = d.call(ctx)
	err = d.api.CopyToContainer(cctx, resp.ID, "/", bytes.NewReader(seed), container.CopyToContainerOptions{})
	cancel()
	if err != nil {
		return LeaseFacts{}, nil, fmt.Errorf("write host key into %s: %w", name, err)
	}
	cctx, cancel = d.call(ctx)
	err = d.api.ContainerStart(cctx, resp.ID, container.StartOptions{})
	cancel()
	if err != nil {
		return LeaseFacts{}, nil, fmt.Errorf("start container %s: %w", name, err)
	}
	facts := LeaseFacts{
		Provider:   KindDocker,
		ID:         LeaseID("docker:" + resp.ID),
		ContractID: resp.ID,
		Metadata: map[string]string{
			"container_id":   resp.ID,
			"container_name": name,
			"image":          spec.Docker.Image,
			"network":        spec.Docker.Network,
			"node":           spec.Name,
		},
		HostKeys: []string{AuthorizedKey(hostPub)},
	}
	ep, ok, err := d.LookupEndpoint(ctx, facts)
	if err != nil {
		return facts, nil, err
	}
	if !ok {
		return facts, nil, nil
	}
	facts.Metadata["ssh_host"], facts.Metadata["ssh_port"] = ep.Host, strconv.Itoa(ep.Port)
	return facts, &ep, nil
}

// LookupEndpoint finds the container's address on its network; ok is
// false when it has none (not running, or not attached).
func (d *DockerLease) LookupEndpoint(ctx context.Context, lease LeaseFacts) (Endpoint, bool, error) {
	cctx, cancel := d.call(ctx)
	info, err := d.api.ContainerInspect(cctx, lease.ContractID)
	cancel()
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return Endpoint{}, false, nil
		}
		return Endpoint{}, false, fmt.Errorf("inspect container %.12s: %w", lease.ContractID, err)
	}
	if info.State == nil || !info.State.Running || info.NetworkSettings == nil {
		return Endpoint{}, false, nil
	}
	ip := ""
	netName := lease.Metadata["network"]
	if netName == "" {
		netName = "bridge"
	}
	if es, ok := info.NetworkSettings.Networks[netName]; ok && es != nil {
		ip = es.IPAddress
	}
	if ip == "" {
		return Endpoint{}, false, nil
	}
	return Endpoint{Host: ip, Port: 22, User: "root", HostKeys: append([]string(nil), lease.HostKeys...)}, true, nil
}

// Destroy removes the node's container by force after checking it is this
// agent's container of that node (ErrNotOwned otherwise), giving it
// StopTimeout to shut down first. Gone already is success. A handle of
// another provider is refused.
func (d *DockerLease) Destroy(ctx context.Context, h DestroyHandle) error {
	if h.Provider != KindDocker {
		return fmt.Errorf("docker lease: refusing a %q destroy handle", h.Provider)
	}
	ref := h.ContractID
	if ref == "" {
		ref = d.ContainerName(h.Node)
	}
	cctx, cancel := d.call(ctx)
	info, err := d.api.ContainerInspect(cctx, ref)
	cancel()
	if err != nil {
		if cerrdefs.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("inspect container %.12s: %w", ref, err)
	}
	if info.Config == nil || !d.owned(info.Config.Labels, h.Node) {
		return fmt.Errorf("remove container %s: %w", strings.TrimPrefix(info.Name, "/"), ErrNotOwned)
	}
	if info.State != nil && info.State.Running {
		// A clean shutdown first, so that the node's agent leaves the mesh
		// rather than being declared dead; whatever happens, removal
		// below is forced.
		secs := int(d.cfg.StopTimeout / time.Second)
		sctx, scancel := context.WithTimeout(ctx, d.cfg.StopTimeout+d.cfg.CallTimeout)
		_ = d.api.ContainerStop(sctx, info.ID, container.StopOptions{Timeout: &secs})
		scancel()
	}
	cctx, cancel = d.call(ctx)
	err = d.api.ContainerRemove(cctx, info.ID, container.RemoveOptions{Force: true})
	cancel()
	if err != nil && !cerrdefs.IsNotFound(err) {
		return fmt.Errorf("remove container %s: %w", strings.TrimPrefix(info.Name, "/"), err)
	}
	return nil
}
