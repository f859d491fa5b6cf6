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

// DockerClient is the Docker client the agent uses: the Engine API calls
// infermesh makes (DockerAPI, ImageAPI, HelperAPI and node bootstrap's),
// each made after the API version was negotiated once, under a lock. It
// holds its *client.Client rather than embedding it, so no call can reach
// the engine around the negotiation: the client's own lazy negotiation
// writes its version field on whichever request comes first, racing
// concurrent requests (seen under -race: a sweep's list against an
// instance's inspect), and it ignores a failed ping. Until the daemon
// answers a negotiation, every call fails with ErrDaemonUnreachable.
type DockerClient struct {
	c          *client.Client
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
	return &DockerClient{c: c}, nil
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
	ping, err := c.c.Ping(ctx)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDaemonUnreachable, c.c.DaemonHost(), err)
	}
	c.c.NegotiateAPIVersionPing(ping)
	c.negotiated.Store(true)
	return nil
}

// ContainerCreate implements DockerAPI.
func (c *DockerClient) ContainerCreate(ctx context.Context, config *container.Config, hostConfig *container.HostConfig, networkingConfig *network.NetworkingConfig, platform *ocispec.Platform, name string) (container.CreateResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.CreateResponse{}, err
	}
	return c.c.ContainerCreate(ctx, config, hostConfig, networkingConfig, platform, name)
}

// ContainerStart implements DockerAPI.
func (c *DockerClient) ContainerStart(ctx context.Context, id string, options container.StartOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.c.ContainerStart(ctx, id, options)
}

// ContainerStop implements DockerAPI.
func (c *DockerClient) ContainerStop(ctx context.Context, id string, options container.StopOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.c.ContainerStop(ctx, id, options)
}

// ContainerRemove implements DockerAPI.
func (c *DockerClient) ContainerRemove(ctx context.Context, id string, options container.RemoveOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.c.ContainerRemove(ctx, id, options)
}

// ContainerInspect implements DockerAPI.
func (c *DockerClient) ContainerInspect(ctx context.Context, id string) (container.InspectResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.InspectResponse{}, err
	}
	return c.c.ContainerInspect(ctx, id)
}

// ContainerList implements DockerAPI.
func (c *DockerClient) ContainerList(ctx context.Context, options container.ListOptions) ([]container.Summary, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.c.ContainerList(ctx, options)
}

// ContainerLogs implements DockerAPI.
func (c *DockerClient) ContainerLogs(ctx context.Context, id string, options container.LogsOptions) (io.ReadCloser, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.c.ContainerLogs(ctx, id, options)
}

// ContainerWait implements DockerAPI.
func (c *DockerClient) ContainerWait(ctx context.Context, id string, condition container.WaitCondition) (<-chan container.WaitResponse, <-chan error) {
	if err := c.negotiate(ctx); err != nil {
		errc := make(chan error, 1)
		errc <- err
		return make(chan container.WaitResponse), errc
	}
	return c.c.ContainerWait(ctx, id, condition)
}

// ImageRemove implements HelperAPI.
func (c *DockerClient) ImageRemove(ctx context.Context, ref string, options image.RemoveOptions) ([]image.DeleteResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.c.ImageRemove(ctx, ref, options)
}

// ImagePull implements ImageAPI.
func (c *DockerClient) ImagePull(ctx context.Context, ref string, options image.PullOptions) (io.ReadCloser, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.c.ImagePull(ctx, ref, options)
}

// Close releases the client's connections.
func (c *DockerClient) Close() error { return c.c.Close() }

// DaemonHost is the engine's address (unix:///var/run/docker.sock, ...).
func (c *DockerClient) DaemonHost() string { return c.c.DaemonHost() }
