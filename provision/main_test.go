package provision

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/network"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/internal/testing/testimage"
	"github.com/infermesh/infermesh/placement"
)

// testImage is the image the engine tests run, built FROM scratch from the
// static demo model binary and the test helpers (internal/testing/testimage). Its
// default command serves the demo model on 0.0.0.0:8080. The tag is unique
// to this test run, so a build in another work tree cannot swap the image
// under a running test, and it is removed when the tests end.
var testImage = fmt.Sprintf("%s-provision-%s", testimage.Tag, runID)

var testImg = &testimage.Lazy{Tag: testImage}

// runID makes this test run's site names unique, so parallel runs (and
// other engineers' runs) on one engine never see each other's containers.
var runID = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)

var siteSeq atomic.Int64

func TestMain(m *testing.M) {
	code := m.Run()
	demoBin.Remove()
	if err := testImg.Remove(); err != nil {
		fmt.Fprintln(os.Stderr, "provision tests: remove test image:", err)
	}
	code = leakcheck.Check(code)
	os.Exit(code)
}

// demoBin is the static demo model binary the native tests run.
var demoBin = &testbin.Lazy{Pkgs: []string{"./cmd/infermesh-demo"}}

// demoBinary returns the path of the static demo model binary, building it
// on first use.
func demoBinary(t *testing.T) string { return demoBin.Get(t)["infermesh-demo"] }

// requireEngine is where every test that runs containers starts: it skips
// in -short mode only, and otherwise builds the test image once and fails
// the test (never skips it) when the engine cannot build it.
func requireEngine(t *testing.T) { testImg.Require(t) }

// engineSite requires the engine (requireEngine) and returns a site name
// unique to this test run and test. It registers a cleanup that
// force-removes every container labeled with the site, whatever happens in
// the test.
func engineSite(t *testing.T) string {
	t.Helper()
	requireEngine(t)
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
func demoSpec(role string, attempt uint64) ProvisionSpec {
	return ProvisionSpec{
		RunID:      0,
		InstanceID: 1,
		AttemptID:  attempt,
		Image:      testImage,
		Args:       []string{"/infermesh-demo", "-listen", "0.0.0.0:8080", "-model", "demo-" + role},
		Env:        []EnvVar{{Name: "INFERMESH_TEST", Value: "1"}},
		Role:       role,
		Ports:      []int{8080},
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

// docker is the Providers map of a Docker-only manager.
func docker(p InstanceProvider) map[string]InstanceProvider {
	return map[string]InstanceProvider{RuntimeDocker: p}
}
