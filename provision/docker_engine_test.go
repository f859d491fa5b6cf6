package provision

import (
	"context"
	"errors"
	"fmt"
	"github.com/infermesh/infermesh/internal/testing/testimage"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"
)

// These tests run against the real Docker engine on this machine.

func newTestProvider(t *testing.T, api DockerAPI, site, node string) *DockerProvider {
	t.Helper()
	p, err := NewDockerProvider(api, DockerConfig{Site: site, Node: node, StopTimeout: time.Second, CallTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("NewDockerProvider: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// engineProvider returns a new site (engineSite), a real client and a
// provider for node n1 of that site.
func engineProvider(t *testing.T) (string, *DockerClient, *DockerProvider) {
	t.Helper()
	site := engineSite(t)
	cli := testClient(t)
	return site, cli, newTestProvider(t, cli, site, "n1")
}

func waitHealthy(t *testing.T, endpoint string) {
	t.Helper()
	c := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := c.Get("http://" + endpoint + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET http://%s/health never answered 200 (last error %v)", endpoint, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func createStarted(t *testing.T, p *DockerProvider, spec ProvisionSpec, sink Sink) (InstanceHandle, ResourceStatus) {
	t.Helper()
	ctx := context.Background()
	h, err := p.CreateInstance(ctx, spec, sink)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	if err := p.StartInstance(ctx, h); err != nil {
		t.Fatalf("StartInstance: %v", err)
	}
	st, err := p.Status(ctx, h.Ref)
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	return h, st
}

func TestEngineCreateServesDemoModelOnLoopbackOnly(t *testing.T) {
	t.Parallel()
	site, cli, p := engineProvider(t)
	ctx := context.Background()

	rec := newRecorder()
	spec := demoSpec("chat", 1)
	h, st := createStarted(t, p, spec, rec)
	if got, want := h.Ref, "infermesh-"+site+"-n1-chat-1"; got != want {
		t.Errorf("ref = %q, want %q", got, want)
	}
	if got, want := p.ProviderRef(spec), h.Ref; got != want {
		t.Errorf("ProviderRef = %q, want %q", got, want)
	}
	ep, ok := st.Endpoints[8080]
	if !ok || !st.Running {
		t.Fatalf("status = %+v, want running with an endpoint for 8080", st)
	}
	waitHealthy(t, ep)

	// A chat completion through the published loopback port reaches the model.
	body := `{"model":"demo-chat","messages":[{"role":"user","content":"hi"}]}`
	resp, err := http.Post("http://"+ep+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("chat completion: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"choices"`) || !strings.Contains(string(b), "demo-chat") {
		t.Fatalf("chat completion = %d %s, want 200 with choices from demo-chat", resp.StatusCode, b)
	}

	// Published on 127.0.0.1 only, by the engine's own account...
	info, err := cli.ContainerInspect(ctx, h.ResourceID)
	if err != nil {
		t.Fatal(err)
	}
	for port, bindings := range info.HostConfig.PortBindings {
		for _, b := range bindings {
			if b.HostIP != "127.0.0.1" {
				t.Errorf("binding %s host ip = %q, want 127.0.0.1", port, b.HostIP)
			}
		}
	}
	for port, bindings := range info.NetworkSettings.Ports {
		for _, b := range bindings {
			if b.HostIP != "127.0.0.1" {
				t.Errorf("published %s on %q, want 127.0.0.1", port, b.HostIP)
			}
		}
	}
	// ...and in fact: the host's non-loopback addresses do not answer.
	_, hostPort, _ := net.SplitHostPort(ep)
	for _, ip := range hostAddrs(t) {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(ip, hostPort), time.Second)
		if err == nil {
			c.Close()
			t.Errorf("dial %s:%s succeeded, want the port reachable on loopback only", ip, hostPort)
		}
	}

	// Labels carry ownership and identity.
	l := info.Config.Labels
	want := map[string]string{
		LabelManagedBy: ManagedByValue, LabelSite: site, LabelNode: "n1", LabelRole: "chat",
		LabelRun: "0", LabelAttempt: "1", LabelTarget: "n1", LabelSpecHash: spec.Hash(),
	}
	for k, v := range want {
		if l[k] != v {
			t.Errorf("label %s = %q, want %q", k, l[k], v)
		}
	}

	// The demo model's own log lines arrive as observations.
	rec.waitFor(t, 10*time.Second, func(o Observation) bool {
		return (o.Kind == ObsStderr || o.Kind == ObsStdout) && o.Ref == h.Ref && o.Line != ""
	})
}

// hostAddrs returns this host's non-loopback IPv4 addresses.
func hostAddrs(t *testing.T) []string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			out = append(out, n.IP.String())
		}
	}
	if len(out) == 0 {
		t.Fatal("no non-loopback IPv4 address to check the binding against")
	}
	return out
}

func TestEngineMounts(t *testing.T) {
	t.Parallel()
	_, cli, p := engineProvider(t)
	tests := []struct {
		name     string
		readOnly bool
		status   int
		stream   ObservationKind
		line     string
	}{
		{"read-only mount refuses writes", true, 3, ObsStderr, "read-only file system"},
		{"read-write mount accepts writes", false, 0, ObsStdout, "wrote /data/out"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			spec := ProvisionSpec{
				AttemptID: 1, InstanceID: uint64(i + 1), Image: testImage,
				Role:   fmt.Sprintf("rw%d", i),
				Args:   []string{"/rowrite", "/data/out"},
				Mounts: []Mount{{HostPath: dir, ContainerPath: "/data", ReadOnly: tt.readOnly}},
			}
			rec := newRecorder()
			h, _ := createStarted(t, p, spec, rec)
			exit, seen := rec.waitFor(t, 30*time.Second, func(o Observation) bool { return o.Kind == ObsExited })
			if exit.Status == nil || *exit.Status != tt.status {
				t.Errorf("exit status = %v, want %d", exit.Status, tt.status)
			}
			found := false
			for _, o := range seen {
				if o.Kind == tt.stream && strings.Contains(o.Line, tt.line) {
					found = true
				}
			}
			if !found {
				t.Errorf("no %v line containing %q before the exit; saw %+v", tt.stream, tt.line, seen)
			}
			_, err := os.Stat(filepath.Join(dir, "out"))
			if got, want := err == nil, !tt.readOnly; got != want {
				t.Errorf("file written on host = %v, want %v", got, want)
			}
			info, err := cli.ContainerInspect(context.Background(), h.ResourceID)
			if err != nil {
				t.Fatal(err)
			}
			if got := info.Mounts[0].RW; got == tt.readOnly {
				t.Errorf("mount RW = %v, want %v", got, !tt.readOnly)
			}
		})
	}
}

func TestEngineCreateRefusals(t *testing.T) {
	t.Parallel()
	_, cli, p := engineProvider(t)
	offer := uint64(42)
	tests := []struct {
		name    string
		spec    ProvisionSpec
		offer   *uint64
		wantErr error
	}{
		{"missing mount source", ProvisionSpec{AttemptID: 1, Image: testImage, Role: "m",
			Mounts: []Mount{{HostPath: "/nonexistent/infermesh/model.gguf", ContainerPath: "/m", ReadOnly: true}}}, nil, ErrMountSource},
		{"unbound template", ProvisionSpec{AttemptID: 0, Image: testImage, Role: "tpl"}, nil, ErrTemplateSpec},
		{"exact offer", demoSpec("offer", 1), &offer, ErrOfferUnsupported},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := CreateSelected(context.Background(), p, tt.spec, Discard, tt.offer)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("CreateSelected error = %v, want %v", err, tt.wantErr)
			}
			if _, err := cli.ContainerInspect(context.Background(), p.ProviderRef(tt.spec)); err == nil {
				t.Errorf("container %s exists after a refused create", p.ProviderRef(tt.spec))
			}
		})
	}
}

func TestEngineCreateIsIdempotentAndReplacesStale(t *testing.T) {
	t.Parallel()
	_, cli, p := engineProvider(t)
	ctx := context.Background()

	spec := demoSpec("idem", 1)
	h1, st1 := createStarted(t, p, spec, Discard)
	waitHealthy(t, st1.Endpoints[8080])

	// Same spec, container running: adopted, not recreated, not restarted.
	h2, err := p.CreateInstance(ctx, spec, Discard)
	if err != nil {
		t.Fatalf("second CreateInstance: %v", err)
	}
	if h2.ResourceID != h1.ResourceID {
		t.Errorf("second CreateInstance id = %s, want the running %s", h2.ResourceID, h1.ResourceID)
	}
	st2, err := p.Status(ctx, h2.Ref)
	if err != nil {
		t.Fatal(err)
	}
	if !st2.StartedAt.Equal(st1.StartedAt) {
		t.Errorf("StartedAt changed %v -> %v: container was restarted", st1.StartedAt, st2.StartedAt)
	}

	// Same name, another spec: the stale container is replaced.
	stale := spec
	stale.Env = []EnvVar{{Name: "INFERMESH_TEST", Value: "2"}}
	if p.ProviderRef(stale) != h1.Ref {
		t.Fatalf("test setup: refs differ")
	}
	h3, st3 := createStarted(t, p, stale, Discard)
	if h3.ResourceID == h1.ResourceID {
		t.Fatalf("stale container %s was kept", h1.ResourceID)
	}
	if _, err := cli.ContainerInspect(ctx, h1.ResourceID); err == nil {
		t.Errorf("stale container %s still exists", h1.ResourceID)
	}
	info, err := cli.ContainerInspect(ctx, h3.ResourceID)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := info.Config.Labels[LabelSpecHash], stale.Hash(); got != want {
		t.Errorf("spec hash label = %s, want %s", got, want)
	}
	waitHealthy(t, st3.Endpoints[8080])
}

func TestEngineAdoptPrepareAndStopBySpec(t *testing.T) {
	t.Parallel()
	site := engineSite(t)
	cli := testClient(t)
	ctx := context.Background()
	p1 := newTestProvider(t, cli, site, "n1")

	spec := demoSpec("adopt", 1)
	h, st := createStarted(t, p1, spec, Discard)
	waitHealthy(t, st.Endpoints[8080])
	p1.Close()

	// A new provider (agent restart) adopts the same running container.
	p2 := newTestProvider(t, cli, site, "n1")
	rec := newRecorder()
	a, ok, err := p2.AdoptBySpec(ctx, spec, rec)
	if err != nil || !ok {
		t.Fatalf("AdoptBySpec = %v, %v, want adopted", ok, err)
	}
	if a.Handle.ResourceID != h.ResourceID || !a.Running || a.Ref != h.Ref {
		t.Errorf("adopted %+v, want running %s at %s", a, h.ResourceID, h.Ref)
	}
	st2, err := p2.Status(ctx, a.Ref)
	if err != nil {
		t.Fatal(err)
	}
	if !st2.StartedAt.Equal(st.StartedAt) {
		t.Errorf("adoption restarted the container")
	}
	// The current run's earlier log lines are replayed to the new sink.
	rec.waitFor(t, 10*time.Second, func(o Observation) bool { return o.Kind == ObsStderr || o.Kind == ObsStdout })

	// A spec with another hash is not adopted.
	other := spec
	other.Args = append(append([]string(nil), spec.Args...), "-tokens", "3")
	if _, ok, err := p2.AdoptBySpec(ctx, other, Discard); ok || err != nil {
		t.Errorf("AdoptBySpec(other hash) = %v, %v, want not adopted", ok, err)
	}

	// PrepareBySpec never creates anything...
	missing := demoSpec("missing", 1)
	if _, ok, err := p2.PrepareBySpec(ctx, missing, Discard); ok || err != nil {
		t.Errorf("PrepareBySpec(nothing) = %v, %v, want false, nil", ok, err)
	}
	if _, err := cli.ContainerInspect(ctx, p2.ProviderRef(missing)); err == nil {
		t.Errorf("PrepareBySpec created %s", p2.ProviderRef(missing))
	}
	// ...and picks up a created-but-never-started container, leaving it so.
	created := demoSpec("created", 1)
	hc, err := p2.CreateInstance(ctx, created, Discard)
	if err != nil {
		t.Fatal(err)
	}
	p3 := newTestProvider(t, cli, site, "n1")
	if _, ok, err := p3.AdoptBySpec(ctx, created, Discard); ok || err != nil {
		t.Errorf("AdoptBySpec(created, not running) = %v, %v, want not adopted", ok, err)
	}
	pa, ok, err := p3.PrepareBySpec(ctx, created, Discard)
	if err != nil || !ok || pa.Handle.ResourceID != hc.ResourceID || pa.Running {
		t.Fatalf("PrepareBySpec = %+v, %v, %v, want the created container, not running", pa, ok, err)
	}
	if err := p3.StartInstance(ctx, pa.Handle); err != nil {
		t.Fatalf("StartInstance after prepare: %v", err)
	}
	stc, err := p3.Status(ctx, pa.Ref)
	if err != nil || !stc.Running {
		t.Fatalf("status after start = %+v, %v, want running", stc, err)
	}

	// StopBySpec: removes what exists, and already gone is success.
	for i, want := range []bool{true, false} {
		got, err := p2.StopBySpec(ctx, spec, Discard)
		if err != nil || got != want {
			t.Errorf("StopBySpec #%d = %v, %v, want %v, nil", i+1, got, err, want)
		}
	}
	if _, err := cli.ContainerInspect(ctx, h.ResourceID); err == nil {
		t.Errorf("container %s exists after StopBySpec", h.ResourceID)
	}
	// StopInstance of a container already removed is success too.
	if err := p3.StopInstance(ctx, pa.Handle); err != nil {
		t.Errorf("StopInstance: %v", err)
	}
	if err := p3.StopInstance(ctx, pa.Handle); err != nil {
		t.Errorf("StopInstance again: %v", err)
	}
}

func TestEngineOwnershipIsScopedAndFailsClosed(t *testing.T) {
	t.Parallel()
	site := engineSite(t)
	otherSite := engineSite(t)
	cli := testClient(t)
	ctx := context.Background()
	mine := newTestProvider(t, cli, site, "n1")
	otherNode := newTestProvider(t, cli, site, "n2")
	otherSiteP := newTestProvider(t, cli, otherSite, "n1")

	hMine, err := mine.CreateInstance(ctx, demoSpec("own", 1), Discard)
	if err != nil {
		t.Fatal(err)
	}
	hNode, err := otherNode.CreateInstance(ctx, demoSpec("own", 1), Discard)
	if err != nil {
		t.Fatal(err)
	}
	hSite, err := otherSiteP.CreateInstance(ctx, demoSpec("own", 1), Discard)
	if err != nil {
		t.Fatal(err)
	}
	// An unlabeled container squatting on a name we would derive.
	squat := demoSpec("squat", 1)
	squatName := mine.ProviderRef(squat)
	removeByName(t, cli, squatName)
	if _, err := cli.ContainerCreate(ctx, &container.Config{Image: testImage}, nil, nil, nil, squatName); err != nil {
		t.Fatal(err)
	}

	refs, err := mine.ListManagedRefs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(refs, ","), hMine.Ref; got != want {
		t.Errorf("ListManagedRefs = %s, want %s", got, want)
	}

	// Never touched: another node's, another site's, the unlabeled one.
	for _, ref := range []string{hNode.Ref, hSite.Ref, squatName} {
		if err := mine.RemoveManaged(ctx, ref); !errors.Is(err, ErrNotOwned) {
			t.Errorf("RemoveManaged(%s) = %v, want ErrNotOwned", ref, err)
		}
	}
	if _, err := mine.CreateInstance(ctx, squat, Discard); !errors.Is(err, ErrNotOwned) {
		t.Errorf("CreateInstance over an unlabeled container = %v, want ErrNotOwned", err)
	}
	if _, err := mine.StopBySpec(ctx, squat, Discard); !errors.Is(err, ErrNotOwned) {
		t.Errorf("StopBySpec of an unlabeled container = %v, want ErrNotOwned", err)
	}
	for _, id := range []string{hNode.ResourceID, hSite.ResourceID, squatName} {
		if _, err := cli.ContainerInspect(ctx, id); err != nil {
			t.Errorf("container %s was touched: %v", id, err)
		}
	}
	if err := mine.RemoveManaged(ctx, hMine.Ref); err != nil {
		t.Errorf("RemoveManaged(own) = %v", err)
	}
	if _, err := cli.ContainerInspect(ctx, hMine.ResourceID); err == nil {
		t.Errorf("own container survived RemoveManaged")
	}
}

func TestEngineUnreachableDaemon(t *testing.T) {
	// t.Setenv: not parallel.
	dead := filepath.Join(t.TempDir(), "dead.sock")
	t.Setenv("DOCKER_HOST", "unix://"+dead)
	cli, err := NewDockerClient()
	if err != nil {
		t.Fatalf("NewDockerClient: %v", err)
	}
	defer cli.Close()
	p := newTestProvider(t, cli, "unreachable", "n1")
	ctx := context.Background()
	spec := demoSpec("dead", 1)

	_, err = p.CreateInstance(ctx, spec, Discard)
	if !errors.Is(err, ErrDaemonUnreachable) {
		t.Fatalf("CreateInstance error = %v, want ErrDaemonUnreachable", err)
	}
	// Said once, with the socket named: not "docker daemon unreachable:
	// docker daemon unreachable:".
	if want := "create container infermesh-unreachable-n1-dead-1: docker daemon unreachable: unix://" + dead +
		": Cannot connect to the Docker daemon at unix://" + dead + ". Is the docker daemon running?"; err.Error() != want {
		t.Errorf("CreateInstance error = %q\nwant                   %q", err, want)
	}
	if _, err := p.ListManagedRefs(ctx); !errors.Is(err, ErrDaemonUnreachable) {
		t.Errorf("ListManagedRefs error = %v, want ErrDaemonUnreachable", err)
	}
	if _, err := p.StopBySpec(ctx, spec, Discard); !errors.Is(err, ErrDaemonUnreachable) {
		t.Errorf("StopBySpec error = %v, want ErrDaemonUnreachable", err)
	}
}

// How a run ends, as the engine tells it: a container the kernel killed at
// its memory limit ends with ObsFailed naming the reason (and its status),
// while a process that exits, or is killed for another reason, ends with
// ObsExited. Status says the same.
func TestEngineRunEndsOOMKillIsAFailure(t *testing.T) {
	t.Parallel()
	_, _, p := engineProvider(t)
	eng := testimage.Engine(t)
	const limit = 32 << 20 // bytes; the Go runtime alone fits in it
	tests := []endCase{
		{"allocates past its memory limit", []string{"/memhog", "256"}, limit, false, ObsFailed, 137, "out of memory"},
		{"exits by itself", []string{"/memhog", "8"}, 0, false, ObsExited, 4, ""},
		{"killed, not for memory", demoSpec("x", 1).Args, limit, true, ObsExited, 137, ""},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The engine records an OOM kill from an event of its own, and on
			// a loaded host it sometimes records none (its inspect says
			// OOMKilled false, as the provider then does): that is the
			// fault's report failing, so the fault runs again, at most three
			// times. Whenever the engine recorded the kill, the provider
			// must say so.
			for attempt := 1; ; attempt++ {
				if again := runEnd(t, p, eng, i, attempt, tt); !again {
					return
				}
				t.Logf("attempt %d: the engine recorded no OOM kill; running the fault again", attempt)
			}
		})
	}
}

// endCase is a case of TestEngineRunEndsOOMKillIsAFailure.
type endCase struct {
	name    string
	args    []string
	limit   int64
	kill    bool // kill with SIGKILL once running
	kind    ObservationKind
	status  int
	failure string
}

// runEnd runs one case of TestEngineRunEndsOOMKillIsAFailure. It reports
// whether to run it again: an OOM case the engine recorded no OOM kill of,
// before the third attempt.
func runEnd(t *testing.T, p *DockerProvider, eng *client.Client, i, attempt int, tt endCase) (again bool) {
	t.Helper()
	ctx := context.Background()
	spec := ProvisionSpec{AttemptID: 1, InstanceID: uint64(100*attempt + i + 1), Image: testImage, Role: fmt.Sprintf("end%da%d", i, attempt), Args: tt.args}
	rec := newRecorder()
	h, err := p.CreateInstance(ctx, spec, rec)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	if tt.limit > 0 {
		// The provider sets no memory limit: put one on the created
		// container, as an operator's engine policy could.
		res := container.Resources{Memory: tt.limit, MemorySwap: tt.limit}
		if _, err := eng.ContainerUpdate(ctx, h.ResourceID, container.UpdateConfig{Resources: res}); err != nil {
			t.Fatalf("limit memory: %v", err)
		}
	}
	if err := p.StartInstance(ctx, h); err != nil {
		t.Fatalf("StartInstance: %v", err)
	}
	if tt.kill {
		rec.waitFor(t, 30*time.Second, func(o Observation) bool { return o.Kind == ObsStderr || o.Kind == ObsStdout })
		if err := eng.ContainerKill(ctx, h.ResourceID, "SIGKILL"); err != nil {
			t.Fatalf("kill: %v", err)
		}
	}
	end, seen := rec.waitFor(t, 60*time.Second, func(o Observation) bool { return o.Kind == ObsExited || o.Kind == ObsFailed })
	if tt.failure != "" && end.Kind == ObsExited && attempt < 3 {
		if info, err := eng.ContainerInspect(ctx, h.ResourceID); err == nil && info.State != nil && !info.State.OOMKilled {
			return true
		}
	}
	if end.Kind != tt.kind || end.Status == nil || *end.Status != tt.status || !strings.Contains(end.Reason, tt.failure) {
		t.Errorf("end of run = %v status %v reason %q, want %v status %d reason containing %q", end.Kind, fmtStatus(end.Status), end.Reason, tt.kind, tt.status, tt.failure)
	}
	if tt.kind == ObsExited && end.Reason != "" {
		t.Errorf("exit has reason %q, want none", end.Reason)
	}
	for _, o := range seen {
		if o.Kind == ObsStdout && strings.Contains(o.Line, "holding") && tt.limit > 0 && !tt.kill {
			t.Errorf("memhog held all it asked for under a %d byte limit: %q", tt.limit, o.Line)
		}
	}
	st, err := p.Status(ctx, h.Ref)
	if err != nil {
		t.Fatal(err)
	}
	if st.Running || st.ExitCode != tt.status || !strings.Contains(st.Failure, tt.failure) || (tt.failure == "") != (st.Failure == "") {
		t.Errorf("Status = running %v exit %d failure %q, want stopped, exit %d, failure containing %q", st.Running, st.ExitCode, st.Failure, tt.status, tt.failure)
	}
	return false
}

func fmtStatus(s *int) string {
	if s == nil {
		return "nil"
	}
	return fmt.Sprint(*s)
}
