package provision

import (
	"context"
	"io"

	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/network"
	"github.com/docker/docker/client"
)

// The calls node bootstrap makes beyond DockerAPI (node images, seeding a
// node container's files before it starts, exec, test networks), each
// behind the same one-time API version negotiation.

// ImageInspect wraps the client's call after negotiation.
func (c *DockerClient) ImageInspect(ctx context.Context, ref string, opts ...client.ImageInspectOption) (image.InspectResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return image.InspectResponse{}, err
	}
	return c.c.ImageInspect(ctx, ref, opts...)
}

// ImageImport wraps the client's call after negotiation.
func (c *DockerClient) ImageImport(ctx context.Context, source image.ImportSource, ref string, options image.ImportOptions) (io.ReadCloser, error) {
	if err := c.negotiate(ctx); err != nil {
		return nil, err
	}
	return c.c.ImageImport(ctx, source, ref, options)
}

// CopyToContainer wraps the client's call after negotiation.
func (c *DockerClient) CopyToContainer(ctx context.Context, id, path string, content io.Reader, options container.CopyToContainerOptions) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.c.CopyToContainer(ctx, id, path, content, options)
}

// ContainerExecCreate wraps the client's call after negotiation.
func (c *DockerClient) ContainerExecCreate(ctx context.Context, id string, options container.ExecOptions) (container.ExecCreateResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.ExecCreateResponse{}, err
	}
	return c.c.ContainerExecCreate(ctx, id, options)
}

// ContainerExecAttach wraps the client's call after negotiation.
func (c *DockerClient) ContainerExecAttach(ctx context.Context, execID string, config container.ExecAttachOptions) (types.HijackedResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return types.HijackedResponse{}, err
	}
	return c.c.ContainerExecAttach(ctx, execID, config)
}

// ContainerExecInspect wraps the client's call after negotiation.
func (c *DockerClient) ContainerExecInspect(ctx context.Context, execID string) (container.ExecInspect, error) {
	if err := c.negotiate(ctx); err != nil {
		return container.ExecInspect{}, err
	}
	return c.c.ContainerExecInspect(ctx, execID)
}

// NetworkCreate wraps the client's call after negotiation.
func (c *DockerClient) NetworkCreate(ctx context.Context, name string, options network.CreateOptions) (network.CreateResponse, error) {
	if err := c.negotiate(ctx); err != nil {
		return network.CreateResponse{}, err
	}
	return c.c.NetworkCreate(ctx, name, options)
}

// NetworkInspect wraps the client's call after negotiation.
func (c *DockerClient) NetworkInspect(ctx context.Context, id string, options network.InspectOptions) (network.Inspect, error) {
	if err := c.negotiate(ctx); err != nil {
		return network.Inspect{}, err
	}
	return c.c.NetworkInspect(ctx, id, options)
}

// NetworkRemove wraps the client's call after negotiation.
func (c *DockerClient) NetworkRemove(ctx context.Context, id string) error {
	if err := c.negotiate(ctx); err != nil {
		return err
	}
	return c.c.NetworkRemove(ctx, id)
}
