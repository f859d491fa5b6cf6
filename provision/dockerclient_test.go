package provision

import (
	"context"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"

	"github.com/infermesh/infermesh/internal/testing/testimage"
)

// Whichever call of a fresh DockerClient comes first, it is made at the API
// version negotiated with the engine (this host's engine speaks 1.41, older
// than the library's own version), and while the engine does not answer it
// fails with ErrDaemonUnreachable, naming where the engine was looked for.
// The client library's own lazy negotiation ignores a failed ping and
// sends the request anyway.
func TestDockerClientFirstCallNegotiates(t *testing.T) {
	if testing.Short() {
		t.Skip("talks to the Docker engine; skipped in -short mode only")
	}
	want := testimage.Engine(t).ClientVersion() // negotiated with the engine
	calls := []struct {
		name string
		call func(context.Context, *DockerClient) error
	}{
		{"image pull", func(ctx context.Context, c *DockerClient) error {
			// No registry has the image: the engine answers that it cannot
			// pull it, after it accepted the request's version.
			rc, err := c.ImagePull(ctx, "infermesh-no-such-image:"+runID, image.PullOptions{})
			if err == nil {
				_, _ = io.Copy(io.Discard, rc)
				rc.Close()
			}
			return err
		}},
		{"image inspect", func(ctx context.Context, c *DockerClient) error {
			_, err := c.ImageInspect(ctx, "infermesh-no-such-image:"+runID)
			return err
		}},
		{"container list", func(ctx context.Context, c *DockerClient) error {
			_, err := c.ContainerList(ctx, container.ListOptions{Limit: 1})
			return err
		}},
	}
	for _, tt := range calls {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewDockerClient()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			err = tt.call(ctx, c)
			if err != nil && strings.Contains(err.Error(), "client version") {
				t.Fatalf("first call refused for its API version: %v", err)
			}
			if got := c.c.ClientVersion(); got != want {
				t.Errorf("API version after a first %s = %s, want %s (negotiated)", tt.name, got, want)
			}
		})
		t.Run(tt.name+" without an engine", func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "docker.sock") // nothing listens
			c, err := NewDockerClient(client.WithHost("unix://" + sock))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := tt.call(ctx, c); !errors.Is(err, ErrDaemonUnreachable) || !strings.Contains(err.Error(), sock) {
				t.Errorf("first %s without an engine = %v, want ErrDaemonUnreachable naming %s", tt.name, err, sock)
			}
		})
	}
}
