package provision

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/network"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/internal/testimage"
	"github.com/infermesh/infermesh/placement"
)

// testImage is built in TestMain, FROM scratch, from the static demo model
// binary and the rowrite helper. Its default command serves the demo model
// on 0.0.0.0:8080.
const testImage = testimage.Tag

// runID makes this test run's site names unique, so parallel runs (and
// other engineers' runs) on one engine never see each other's containers.
var runID = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)

var siteSeq atomic.Int64

func TestMain(m *testing.M) {
	if err := buildTestImage(); err != nil {
		fmt.Fprintln(os.Stderr, "provision tests: build test image:", err)
		os.Exit(1)
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func buildTestImage() error {
	root, err := filepath.Abs("..")
	if err != nil {
		return err
	}
	return testimage.Build(root, testImage)
}

// testSite returns a site name unique to this test run and test, and
// registers a cleanup that force-removes every container labeled with it,
// whatever happens in the test.
func testSite(t *testing.T) string {
	t.Helper()
	site := fmt.Sprintf("pt%s-%d", runID, siteSeq.Add(1))
	t.Cleanup(func() { removeSite(t, site) })
	return site
}

func removeSite(t *testing.T, site string) {
	t.Helper()
	cli, err := NewDockerClient()
	if err != nil {
		t.Errorf("cleanup client: %v", err)
		return
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", LabelSite+"="+site))})
	if err != nil {
		t.Errorf("cleanup list: %v", err)
		return
	}
	for _, c := range list {
		if err := cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true}); err != nil && !cerrdefs.IsNotFound(err) {
			t.Errorf("cleanup remove %s: %v", c.ID, err)
		}
	}
}

// testClient returns a real Docker client closed when the test ends.
func testClient(t *testing.T) *DockerClient {
	t.Helper()
	cli, err := NewDockerClient()
	if err != nil {
		t.Fatalf("docker client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// removeByName force-removes a container the test created without labels.
func removeByName(t *testing.T, cli *DockerClient, name string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cli.ContainerRemove(ctx, name, container.RemoveOptions{Force: true}); err != nil && !cerrdefs.IsNotFound(err) {
			t.Errorf("cleanup remove %s: %v", name, err)
		}
	})
}

// demoSpec is a spec serving the demo model on container port 8080.
func demoSpec(role string, attempt uint64) NodeSpec {
	return NodeSpec{
		RunID:     0,
		NodeID:    1,
		AttemptID: attempt,
		Image:     testImage,
		Args:      []string{"/infermesh-demo", "-listen", "0.0.0.0:8080", "-model", "demo-" + role},
		Env:       []EnvVar{{Name: "INFERMESH_TEST", Value: "1"}},
		Role:      role,
		Ports:     []int{8080},
	}
}

// recorder is a Sink that keeps every observation.
type recorder struct {
	ch chan Observation
}

func newRecorder() *recorder { return &recorder{ch: make(chan Observation, 1024)} }

func (r *recorder) Observe(o Observation) {
	select {
	case r.ch <- o:
	default:
	}
}

// waitFor returns the first observation satisfying pred, failing the test
// after timeout. Observations before it are collected in seen.
func (r *recorder) waitFor(t *testing.T, timeout time.Duration, pred func(Observation) bool) (Observation, []Observation) {
	t.Helper()
	var seen []Observation
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		select {
		case o := <-r.ch:
			if pred(o) {
				return o, seen
			}
			seen = append(seen, o)
		case <-deadline.C:
			var lines []string
			for _, o := range seen {
				lines = append(lines, o.Kind.String()+": "+o.Line+o.Reason)
			}
			t.Fatalf("no matching observation within %v; saw:\n%s", timeout, strings.Join(lines, "\n"))
			return Observation{}, nil
		}
	}
}

type (
	networkConfig = network.NetworkingConfig
	platform      = ocispec.Platform
)

type placementLocal = placement.Local
