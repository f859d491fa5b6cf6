package provision

import (
	"context"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/network"
	"github.com/docker/docker/client"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// DockerClient is the Docker client the agent uses: a *client.Client whose
// API version negotiation happens once, under a lock, before any call of
// the DockerAPI. The client's own lazy negotiation writes its version field
// on whichever request comes first, racing concurrent requests (seen under
// -race: a sweep's list against an instance's inspect). Until the daemon
// answers a negotiation, DockerAPI calls fail with ErrDaemonUnreachable.
type DockerClient struct {
	*client.Client
	mu         sync.Mutex
	negotiated atomic.Bool
}

var _ DockerAPI = (*DockerClient)(nil)

// NewDockerClient returns a client configured from the environment
// (DOCKER_HOST, ...), then opts (client.WithHost, ...), that negotiates the
// API version with the daemon, so a v28 client talks to a 20.10 (API 1.41)
// engine. The caller closes it.
func NewDockerClient(opts ...client.Opt) (*DockerClient, error) {
	c, err := client.NewClientWithOpts(append([]client.Opt{client.FromEnv, client.WithAPIVersionNegotiation()}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("docker client: %w", err)
	}
	return &DockerClient{Client: c}, nil
}

// negotiate pins the API version the first time the daemon answers.
func (c *DockerClient) negotiate(ctx context.Context) error {
	if c.negotiated.Load() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.negotiated.Load() {
		return nil
	}
	ping, err := c.Client.Ping(ctx)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDaemonUnreachable, c.Client.DaemonHost(), err)
	}
	c.Client.NegotiateAPIVersionPing(ping)
	c.negotiated.Store(true)
	return nil
}

// ContainerCreate implements DockerAPI.
func (c *DockerClient) ContainerCreate(ctx context.Context, config *container.Config, hostConfig *container.HostConfig, networkingConfig *network.NetworkingConfig, platform *ocispec.Platform, name string) (container.CreateResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.CreateResponse{}, err
	}
	return c.Client.ContainerCreate(ctx, config, hostConfig, networkingConfig, platform, name)
}

// ContainerStart implements DockerAPI.
func (c *DockerClient) ContainerStart(ctx context.Context, id string, options container.StartOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.Client.ContainerStart(ctx, id, options)
}

// ContainerStop implements DockerAPI.
func (c *DockerClient) ContainerStop(ctx context.Context, id string, options container.StopOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.Client.ContainerStop(ctx, id, options)
}

// ContainerRemove implements DockerAPI.
func (c *DockerClient) ContainerRemove(ctx context.Context, id string, options container.RemoveOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.Client.ContainerRemove(ctx, id, options)
}

// ContainerInspect implements DockerAPI.
func (c *DockerClient) ContainerInspect(ctx context.Context, id string) (container.InspectResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.InspectResponse{}, err
	}
	return c.Client.ContainerInspect(ctx, id)
}

// ContainerList implements DockerAPI.
func (c *DockerClient) ContainerList(ctx context.Context, options container.ListOptions) ([]container.Summary, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.Client.ContainerList(ctx, options)
}

// ContainerLogs implements DockerAPI.
func (c *DockerClient) ContainerLogs(ctx context.Context, id string, options container.LogsOptions) (io.ReadCloser, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.Client.ContainerLogs(ctx, id, options)
}

// ContainerWait implements DockerAPI.
func (c *DockerClient) ContainerWait(ctx context.Context, id string, condition container.WaitCondition) (<-chan container.WaitResponse, <-chan error) {
	if err := c.negotiate(ctx); err != nil {
		errc := make(chan error, 1)
		errc <- err
		return make(chan container.WaitResponse), errc
	}
	return c.Client.ContainerWait(ctx, id, condition)
}

// ImageRemove implements HelperAPI.
func (c *DockerClient) ImageRemove(ctx context.Context, ref string, options image.RemoveOptions) ([]image.DeleteResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.Client.ImageRemove(ctx, ref, options)
}
