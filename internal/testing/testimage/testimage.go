// Package testimage builds the container image the Docker tests run: the
// demo model as a static binary in a FROM scratch image. There is no
// registry, so tests build it locally through the engine's API.
package testimage

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/docker/docker/api/types/build"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"

	"github.com/infermesh/infermesh/internal/testing/testbin"
)

// Tag is the image tag tests use.
const Tag = "infermesh-demo:test"

// Build builds tag FROM scratch with the static demo model binary (its
// default command serves the demo model on 0.0.0.0:8080, model "demo") and
// the test helpers: /rowrite (writes a file, exit 3 on failure) and /memhog
// (allocates the MiB it is given, to be OOM-killed). root is the module
// root. Building is idempotent: the engine caches the layers.
//
// Packages test in parallel processes on one engine; each uses its own tag,
// and a build that fails (say, racing another build of the same layers) is
// tried again.
func Build(root, tag string) error {
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if err = buildOnce(root, tag); err == nil {
			return nil
		}
		time.Sleep(time.Second)
	}
	return err
}

func buildOnce(root, tag string) error {
	dir, err := os.MkdirTemp("", "provision-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bins := map[string]string{
		"infermesh-demo": "./cmd/infermesh-demo",
		"rowrite":        "./provision/internal/testbin/rowrite",
		"memhog":         "./provision/internal/testbin/memhog",
	}
	for name, pkg := range bins {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
		}
	}
	dockerfile := "FROM scratch\n" +
		"COPY infermesh-demo /infermesh-demo\n" +
		"COPY rowrite /rowrite\n" +
		"COPY memhog /memhog\n" +
		`CMD ["/infermesh-demo", "-listen", "0.0.0.0:8080", "-model", "demo"]` + "\n"
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: mode, Size: int64(len(data))}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := add("Dockerfile", 0o644, []byte(dockerfile)); err != nil {
		return err
	}
	for name := range bins {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := add(name, 0o755, data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}

	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	resp, err := cli.ImageBuild(ctx, &buf, build.ImageBuildOptions{
		Tags:        []string{tag},
		Remove:      true,
		ForceRemove: true,
	})
	if err != nil {
		return fmt.Errorf("image build: %w", err)
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	for {
		var msg struct {
			Error string `json:"error"`
		}
		if err := dec.Decode(&msg); err == io.EOF {
			break
		} else if err != nil {
			return fmt.Errorf("image build output: %w", err)
		}
		if msg.Error != "" {
			return fmt.Errorf("image build: %s", msg.Error)
		}
	}
	return nil
}

// Lazy is a test binary's image: built by the first test that needs it
// (Require), once, so the tests that need no engine run whatever state the
// engine is in; removed at the end (Remove).
type Lazy struct {
	// Tag is unique to the test run, so a build in another work tree
	// cannot swap the image under a running test.
	Tag string

	once  sync.Once
	err   error
	built atomic.Bool
}

// Require skips the test in -short mode only; otherwise it builds the
// image once and fails the test (never skips it) when the engine cannot.
func (l *Lazy) Require(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("runs containers on the Docker engine; skipped in -short mode only")
	}
	l.once.Do(func() {
		root, err := testbin.ModuleRoot()
		if err == nil {
			err = Build(root, l.Tag)
		}
		l.built.Store(err == nil)
		l.err = err
	})
	if l.err != nil {
		t.Fatalf("building the test image %s (the engine tests need it; -short skips them): %v", l.Tag, l.err)
	}
}

// Remove removes the image if Require built it.
func (l *Lazy) Remove() error {
	if !l.built.Load() {
		return nil
	}
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = cli.ImageRemove(ctx, l.Tag, image.RemoveOptions{PruneChildren: true})
	return err
}

// Engine returns a client of the whole Engine API, for what tests do to
// the engine beyond the calls infermesh makes (kill, pause or limit a
// container, list images). Its API version is negotiated before it is
// returned: the client's own lazy negotiation runs on some calls only. The
// client is closed when the test ends.
func Engine(t testing.TB) *client.Client {
	t.Helper()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatalf("docker client: %v", err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ping, err := cli.Ping(ctx)
	if err != nil {
		t.Fatalf("docker engine at %s: %v", cli.DaemonHost(), err)
	}
	cli.NegotiateAPIVersionPing(ping)
	return cli
}
