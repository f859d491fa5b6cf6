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
	"time"

	"github.com/docker/docker/api/types/build"
	"github.com/docker/docker/client"
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
