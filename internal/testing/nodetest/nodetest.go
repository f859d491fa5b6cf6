// Package nodetest is what tests of node containers share: the node image,
// built (or found) once per test binary, a Docker client, and the removal
// of every container a test labelled with its site.
package nodetest

import (
	"context"
	"sync"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"

	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/provision"
)

var (
	once sync.Once
	tag  string
	err  error
)

// Setup returns a Docker client closed when t ends, and the node image's
// tag, building the image the first time (it takes minutes once per
// engine, then it is cached by its recipe hash).
func Setup(t testing.TB) (*provision.DockerClient, string) {
	t.Helper()
	cli, cerr := provision.NewDockerClient()
	if cerr != nil {
		t.Fatal(cerr)
	}
	t.Cleanup(func() { cli.Close() })
	once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		tag, err = nodeimage.Ensure(ctx, cli, nodeimage.Options{})
	})
	if err != nil {
		t.Fatalf("node image: %v", err)
	}
	return cli, tag
}

// RemoveSiteAtCleanup removes, when t ends, every container labelled with
// site (io.infermesh.site), whatever the test left.
func RemoveSiteAtCleanup(t testing.TB, cli *provision.DockerClient, site string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, c := range SiteContainers(t, cli, site) {
			if err := cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true}); err != nil && !cerrdefs.IsNotFound(err) {
				t.Errorf("remove %s: %v", c.ID, err)
			}
		}
	})
}

// SiteContainers lists the containers (any state) labelled with site.
func SiteContainers(t testing.TB, cli *provision.DockerClient, site string) []container.Summary {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+site))})
	if err != nil {
		t.Errorf("list containers of site %s: %v", site, err)
	}
	return list
}
