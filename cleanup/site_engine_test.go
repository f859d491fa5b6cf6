package cleanup_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/provision"
)

// fixture is one site on this host: its layout in temporary directories,
// the real engine (or a client of a dead one), the provision backends, and
// the resources a test made, all removed when the test ends.
type fixture struct {
	t        *testing.T
	site     string
	layout   cleanup.Layout
	cli      *provision.DockerClient // the real engine, for setting up and checking
	backends *provision.SiteCleanups
	lock     *cleanup.StoreLock

	natives map[string]*provision.NativeProvider
	dockers map[string]*provision.DockerProvider
	specs   map[string][]provision.ProvisionSpec // native specs by node
}

// newFixture makes a site. opts point the backends' Docker client
// elsewhere (a dead socket); the fixture's own client is always the real
// engine.
func newFixture(t *testing.T, opts ...client.Opt) *fixture {
	t.Helper()
	requireEngine(t)
	f := &fixture{
		t:       t,
		site:    fmt.Sprintf("ct%s-%d", runID, siteSeq.Add(1)),
		natives: map[string]*provision.NativeProvider{},
		dockers: map[string]*provision.DockerProvider{},
		specs:   map[string][]provision.ProvisionSpec{},
	}
	f.layout = cleanup.Layout{StateDir: t.TempDir(), CacheRoot: t.TempDir(), Site: f.site}
	var err error
	if f.cli, err = provision.NewDockerClient(); err != nil {
		t.Fatal(err)
	}
	api := f.cli
	if len(opts) > 0 {
		if api, err = provision.NewDockerClient(opts...); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { api.Close() })
	}
	f.backends, err = provision.NewSiteCleanups(provision.SiteCleanupsConfig{
		Docker: api, Layout: f.layout, Node: "a", StopTimeout: 2 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if f.lock, err = cleanup.LockStore(f.layout.StateDir, time.Second, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.teardown)
	return f
}

func (f *fixture) teardown() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for node, specs := range f.specs {
		for _, s := range specs {
			// Stopped through the record: never a bare pid.
			f.natives[node].StopBySpec(ctx, s, nil)
		}
	}
	for _, p := range f.natives {
		p.Close()
	}
	for _, p := range f.dockers {
		p.Close()
	}
	list, err := f.cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+f.site))})
	if err == nil {
		for _, c := range list {
			f.cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true})
		}
	}
	f.lock.Close()
	f.cli.Close()
}

// siteOf is the stopped-site operations of f's site, binding kinds.
func (f *fixture) siteOf(kinds ...cleanup.Kind) *cleanup.Site {
	return &cleanup.Site{Name: f.site, Node: "a", Layout: f.layout, Bound: cleanup.NewKindSet(kinds...), Backends: f.backends, Lock: f.lock}
}

func (f *fixture) dockerOf(node string) *provision.DockerProvider {
	p := f.dockers[node]
	if p == nil {
		var err error
		p, err = provision.NewDockerProvider(f.cli, provision.DockerConfig{Site: f.site, Node: node, StopTimeout: time.Second})
		if err != nil {
			f.t.Fatal(err)
		}
		f.dockers[node] = p
	}
	return p
}

// container creates (and with start, starts) node's container for role.
func (f *fixture) container(node, role string, start bool) provision.InstanceHandle {
	f.t.Helper()
	ctx := context.Background()
	spec := provision.ProvisionSpec{
		InstanceID: 1, AttemptID: 1, Role: role, Image: testImage, Ports: []int{8080},
		Args: []string{"/infermesh-demo", "-listen", "0.0.0.0:8080"},
	}
	p := f.dockerOf(node)
	h, err := p.CreateInstance(ctx, spec, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	if start {
		if err := p.StartInstance(ctx, h); err != nil {
			f.t.Fatal(err)
		}
	}
	return h
}

// rawContainer creates a container with exactly labels (no provider).
func (f *fixture) rawContainer(name string, labels map[string]string) string {
	f.t.Helper()
	ctx := context.Background()
	resp, err := f.cli.ContainerCreate(ctx, &container.Config{Image: testImage, Labels: labels}, nil, nil, nil, name)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		f.cli.ContainerRemove(ctx, resp.ID, container.RemoveOptions{Force: true})
	})
	return resp.ID
}

func (f *fixture) exists(id string) bool {
	f.t.Helper()
	_, err := f.cli.ContainerInspect(context.Background(), id)
	if err != nil && !cerrdefs.IsNotFound(err) {
		f.t.Fatal(err)
	}
	return err == nil
}

func (f *fixture) nativeOf(node string) *provision.NativeProvider {
	p := f.natives[node]
	if p == nil {
		var err error
		p, err = provision.NewNativeProvider(provision.NativeConfig{
			Site: f.site, Node: node, Dir: f.layout.NodeDir(node), CacheDir: f.layout.NodeCache(node),
			StopTimeout: 2 * time.Second,
		})
		if err != nil {
			f.t.Fatal(err)
		}
		f.natives[node] = p
	}
	return p
}

// stopFollowing closes the native providers, as a stopped agent does:
// site cleanup runs only then. The processes keep running; a provider still
// following one would write its record again when the cleanup ends it.
func (f *fixture) stopFollowing() {
	for _, p := range f.natives {
		p.Close()
	}
}

// process starts node's native instance of role (the demo model) and
// returns its pid once it answers.
func (f *fixture) process(node, role string) int {
	f.t.Helper()
	ctx := context.Background()
	port := testnet.TCPPort(f.t, "127.0.0.1")
	spec := provision.ProvisionSpec{
		InstanceID: 2, AttemptID: 1, Role: role, Runtime: provision.RuntimeNative, Command: binary(f.t, "infermesh-demo"),
		Args: []string{"-listen", "127.0.0.1:" + strconv.Itoa(port)}, Ports: []int{port},
	}
	p := f.nativeOf(node)
	h, err := p.CreateInstance(ctx, spec, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	f.specs[node] = append(f.specs[node], spec)
	if err := p.StartInstance(ctx, h); err != nil {
		f.t.Fatal(err)
	}
	testproc.WaitUntil(f.t, role+" on "+node+" to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })
	st, err := p.Status(ctx, h.Ref)
	if err != nil || !st.Running {
		f.t.Fatalf("Status = %+v, %v", st, err)
	}
	return st.Pid
}

// writeRecord writes a workload record by hand into node's folder.
func (f *fixture) writeRecord(node, ref string, r provision.WorkloadRecord) string {
	f.t.Helper()
	dir := filepath.Join(f.layout.NodeDir(node), "workloads")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		f.t.Fatal(err)
	}
	b, _ := json.Marshal(r)
	path := filepath.Join(dir, ref+".json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		f.t.Fatal(err)
	}
	return path
}

func refs(rs []cleanup.Resource) []string {
	out := make([]string, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.Runtime+": "+r.Ref)
	}
	return out
}

func targets(t *testing.T, nodes ...string) cleanup.Scope {
	t.Helper()
	s, err := cleanup.TargetScope(nodes...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestScopes: each scope on the real engine and with real native
// processes. A node's scope removes exactly that node's containers and
// processes; the site scope removes every node's; nothing of another site,
// nor anything unlabelled, is touched; running a cleanup twice is safe.
func TestScopes(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	aC := f.container("a", "chat", true)
	bC := f.container("b", "chat", false)
	aP := f.process("a", "embed")
	bP := f.process("b", "embed")
	f.stopFollowing()

	other := newFixture(t)
	otherC := other.container("a", "chat", false)
	unlabelled := f.rawContainer("infermesh-"+f.site+"-a-unlabelled-1", nil)

	s := f.siteOf(cleanup.Docker, cleanup.Native)
	inv, err := s.Inventory(ctx, cleanup.SiteScope())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"Docker runtime: " + aC.Ref, "Docker runtime: " + bC.Ref,
		"native runtime: infermesh-" + f.site + "-a-embed-1", "native runtime: infermesh-" + f.site + "-b-embed-1",
	}
	if got := refs(inv.Resources); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("site inventory = %v, want %v (grouped by runtime, in discovery order)", got, want)
	}
	if len(inv.Skipped) != 0 {
		t.Errorf("skipped = %v", inv.Skipped)
	}
	for _, r := range inv.Resources {
		for _, part := range []string{"role " + r.Role, "node " + r.Target, "attempt 1"} {
			if !strings.Contains(r.Description, part) {
				t.Errorf("description %q does not say %q", r.Description, part)
			}
		}
	}
	if d := inv.Resources[0].Description; !strings.Contains(d, "running") || !strings.Contains(d, "container") {
		t.Errorf("description %q does not say it is a running container", d)
	}
	if d := inv.Resources[2].Description; !strings.Contains(d, fmt.Sprintf("process %d", aP)) {
		t.Errorf("description %q does not name its process %d", d, aP)
	}

	// targets a: a's container and process, nothing of b's.
	out, err := s.Cleanup(ctx, targets(t, "a"), false)
	if err != nil {
		t.Fatal(err)
	}
	if got := refs(out.Removed); len(got) != 2 || !strings.Contains(got[0], aC.Ref) || !strings.Contains(got[1], "-a-embed-1") {
		t.Errorf("targets a removed %v", got)
	}
	if f.exists(aC.ResourceID) || testproc.Alive(aP) {
		t.Errorf("a's container (%v) or process (%v) survived targets a", f.exists(aC.ResourceID), testproc.Alive(aP))
	}
	if !f.exists(bC.ResourceID) || !testproc.Alive(bP) {
		t.Fatalf("b's container or process did not survive targets a")
	}
	if _, err := os.Stat(filepath.Join(f.layout.NodeDir("a"), "workloads", "infermesh-"+f.site+"-a-embed-1.json")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a's record is left: %v", err)
	}
	// Again: nothing left to do, and that is success.
	if out, err := s.Cleanup(ctx, targets(t, "a"), false); err != nil || len(out.Removed) != 0 {
		t.Errorf("second targets a = %v, %v", refs(out.Removed), err)
	}

	// The site scope: every node's.
	out, err = s.Cleanup(ctx, cleanup.SiteScope(), false)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Removed) != 2 || f.exists(bC.ResourceID) || testproc.Alive(bP) {
		t.Errorf("site cleanup removed %v; b's container exists %v, process alive %v", refs(out.Removed), f.exists(bC.ResourceID), testproc.Alive(bP))
	}
	if out, err := s.Cleanup(ctx, cleanup.SiteScope(), false); err != nil || len(out.Removed) != 0 {
		t.Errorf("second site cleanup = %v, %v", refs(out.Removed), err)
	}
	if !f.exists(otherC.ResourceID) || !f.exists(unlabelled) {
		t.Errorf("another site's container (%v) or an unlabelled one (%v) was touched", f.exists(otherC.ResourceID), f.exists(unlabelled))
	}
}

// TestLegacyTargetLabel: a container created when the target label held
// "docker" is attributed to its node label.
func TestLegacyTargetLabel(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	legacy := func(node, name string) string {
		return f.rawContainer(name, map[string]string{
			provision.LabelManagedBy: provision.ManagedByValue, provision.LabelSite: f.site,
			provision.LabelNode: node, provision.LabelTarget: provision.LegacyTargetDocker,
			provision.LabelRole: "chat", provision.LabelAttempt: "1",
		})
	}
	aOld := legacy("a", "infermesh-"+f.site+"-a-chat-1")
	bOld := legacy("b", "infermesh-"+f.site+"-b-chat-1")
	// A node that is named docker: both labels agree.
	dockerNode := legacy("docker", "infermesh-"+f.site+"-docker-chat-1")
	s := f.siteOf(cleanup.Docker)

	inv, err := s.Inventory(ctx, targets(t, "a"))
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Resources) != 1 || inv.Resources[0].ID != aOld || inv.Resources[0].Target != "a" ||
		!strings.Contains(inv.Resources[0].Description, `legacy target label "docker"`) {
		t.Fatalf("targets a = %+v, want only a's legacy container, said to be legacy", inv.Resources)
	}
	if _, err := s.Cleanup(ctx, targets(t, "a"), false); err != nil {
		t.Fatal(err)
	}
	if f.exists(aOld) || !f.exists(bOld) || !f.exists(dockerNode) {
		t.Errorf("after targets a: a's %v, b's %v, node docker's %v; want only a's gone", f.exists(aOld), f.exists(bOld), f.exists(dockerNode))
	}
	inv, err = s.Inventory(ctx, targets(t, "docker"))
	if err != nil || len(inv.Resources) != 1 || inv.Resources[0].ID != dockerNode || strings.Contains(inv.Resources[0].Description, "legacy") {
		t.Errorf("targets docker = %+v, %v; want node docker's own container", inv.Resources, err)
	}
}

// TestUnattributableFailsClosed: in a targets scope, a site resource whose
// target label (or record) is missing or malformed fails the whole cleanup
// and nothing is removed; the site scope removes it with the rest.
func TestUnattributableFailsClosed(t *testing.T) {
	for _, tt := range []struct {
		name string
		make func(f *fixture) string // returns what the error must name
	}{
		{"container without a target label", func(f *fixture) string {
			name := "infermesh-" + f.site + "-c-chat-1"
			f.rawContainer(name, map[string]string{provision.LabelManagedBy: provision.ManagedByValue, provision.LabelSite: f.site, provision.LabelNode: "c"})
			return name
		}},
		{"container with a malformed target label", func(f *fixture) string {
			name := "infermesh-" + f.site + "-c-chat-2"
			f.rawContainer(name, map[string]string{provision.LabelManagedBy: provision.ManagedByValue, provision.LabelSite: f.site, provision.LabelTarget: "../etc"})
			return name
		}},
		{"legacy label without a node", func(f *fixture) string {
			name := "infermesh-" + f.site + "-c-chat-3"
			f.rawContainer(name, map[string]string{provision.LabelManagedBy: provision.ManagedByValue, provision.LabelSite: f.site, provision.LabelTarget: "docker"})
			return name
		}},
		{"native record without a target", func(f *fixture) string {
			return f.writeRecord("c", "infermesh-"+f.site+"-c-x-1", provision.WorkloadRecord{Site: f.site, Node: "c", Ref: "infermesh-" + f.site + "-c-x-1", State: provision.WorkloadExited})
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			ctx := context.Background()
			aC := f.container("a", "chat", false)
			bC := f.container("b", "chat", false)
			aP := f.process("a", "embed")
			bad := tt.make(f)
			s := f.siteOf(cleanup.Docker, cleanup.Native)

			if _, err := s.Inventory(ctx, targets(t, "a")); !errors.Is(err, cleanup.ErrUnattributable) || !strings.Contains(err.Error(), bad) {
				t.Errorf("inventory = %v, want ErrUnattributable naming %s", err, bad)
			}
			out, err := s.Cleanup(ctx, targets(t, "a"), false)
			if !errors.Is(err, cleanup.ErrUnattributable) || !strings.Contains(err.Error(), bad) {
				t.Errorf("cleanup = %v, want ErrUnattributable naming %s", err, bad)
			}
			if len(out.Removed) != 0 || !f.exists(aC.ResourceID) || !testproc.Alive(aP) || !f.exists(bC.ResourceID) {
				t.Fatalf("a failed cleanup removed %v (a's container %v, a's process %v, b's container %v)",
					refs(out.Removed), f.exists(aC.ResourceID), testproc.Alive(aP), f.exists(bC.ResourceID))
			}
			// The whole site: attribution does not matter.
			out, err = s.Cleanup(ctx, cleanup.SiteScope(), false)
			if err != nil || len(out.Removed) != 4 {
				t.Errorf("site cleanup = %v, %v; want all four removed", refs(out.Removed), err)
			}
		})
	}
}

// TestUnreachableDocker: a Docker daemon that does not answer (a client of
// a dead socket; the machine's daemon is never stopped) is skipped, with
// the reason, when the site does not bind Docker, and fails the operation
// before anything is removed when it does, or when the config could not
// be read.
func TestUnreachableDocker(t *testing.T) {
	dead := "unix://" + filepath.Join(t.TempDir(), "dead.sock")
	ctx := context.Background()
	for _, tt := range []struct {
		name  string
		kinds cleanup.KindSet
		fails bool
	}{
		{"optional", cleanup.NewKindSet(cleanup.Native), false},
		{"simulated selects nothing", cleanup.NewKindSet(cleanup.Simulated), false},
		{"bound", cleanup.NewKindSet(cleanup.Docker, cleanup.Native), true},
		{"unreadable config", cleanup.AllKinds(), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, client.WithHost(dead))
			c := f.container("a", "chat", false) // on the real engine, unseen
			pid := f.process("a", "embed")
			s := f.siteOf(tt.kinds.Kinds()...)
			inv, ierr := s.Inventory(ctx, cleanup.SiteScope())
			out, cerr := s.Cleanup(ctx, cleanup.SiteScope(), false)
			if tt.fails {
				for _, err := range []error{ierr, cerr} {
					if !errors.Is(err, cleanup.ErrUnreachable) || !strings.Contains(err.Error(), "dead.sock") || !strings.Contains(err.Error(), "bound") {
						t.Errorf("err = %v, want ErrUnreachable saying Docker is bound", err)
					}
				}
				if !testproc.Alive(pid) {
					t.Error("a failed cleanup stopped the native process")
				}
				return
			}
			if ierr != nil || cerr != nil {
				t.Fatalf("inventory %v, cleanup %v", ierr, cerr)
			}
			for _, sk := range [][]cleanup.Skipped{inv.Skipped, out.Skipped} {
				if len(sk) != 1 || sk[0].Runtime != provision.DockerRuntimeName || !strings.Contains(sk[0].Reason.Error(), "dead.sock") {
					t.Errorf("skipped = %+v, want the Docker runtime with its reason", sk)
				}
			}
			if len(out.Removed) != 1 || testproc.Alive(pid) {
				t.Errorf("removed %v (process alive %v), want the native process removed", refs(out.Removed), testproc.Alive(pid))
			}
			if !f.exists(c.ResourceID) {
				t.Error("the container on the real engine was removed through a dead client")
			}
		})
	}
}

// TestUnknownBindingBeforeAnyConnection: an unknown binding fails before any
// runtime is contacted. The Docker client points at a socket that counts
// connections.
func TestUnknownBindingBeforeAnyConnection(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "counting.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var conns atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	f := newFixture(t, client.WithHost("unix://"+sock))
	ctx := context.Background()

	_, perr := cleanup.ParseSiteConfig([]byte("roles:\n  chat: {port: 1, instance: {runtime: futureRuntime}}\n"))
	s := f.siteOf(cleanup.Kind("futureRuntime"), cleanup.Docker)
	_, ierr := s.Inventory(ctx, cleanup.SiteScope())
	_, cerr := s.Delete(ctx, false)
	for _, err := range []error{perr, ierr, cerr} {
		var ub *cleanup.UnknownBindingError
		if !errors.As(err, &ub) || ub.Adapter != "futureRuntime" {
			t.Errorf("err = %v, want the unknown-binding error", err)
		}
	}
	if n := conns.Load(); n != 0 {
		t.Errorf("%d connections to the Docker socket before the unknown binding failed", n)
	}
	// The counter works: a known binding does connect.
	s.Bound = cleanup.NewKindSet(cleanup.Docker)
	if _, err := s.Inventory(ctx, cleanup.SiteScope()); err == nil {
		t.Error("inventory through a socket that hangs up succeeded")
	}
	if conns.Load() == 0 {
		t.Error("no connection counted")
	}
}

// TestForgedRecordsRefused: a workload record that is not evidence of the
// process it names refuses the whole operation, naming why, before
// anything stops: the unrelated process lives on, and so does every other
// resource in scope.
func TestForgedRecordsRefused(t *testing.T) {
	sleep := exec.Command("/bin/sleep", "1000")
	sleep.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleep.Process.Kill(); sleep.Wait() })
	pid := sleep.Process.Pid
	stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	start, _ := strconv.ParseUint(fields[19], 10, 64)
	exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")

	for _, tt := range []struct {
		name string
		rec  func(site string) provision.WorkloadRecord
		why  string
	}{
		{"live pid of an unrelated process", func(site string) provision.WorkloadRecord {
			return provision.WorkloadRecord{Site: site, Node: "a", Target: "a", Ref: "forged", State: provision.WorkloadRunning,
				Pid: pid, StartTime: start, Executable: exe, BootID: strings.TrimSpace(string(boot)), Token: "0123456789abcdef0123456789abcdef", Command: exe}
		}, "does not carry the workload's token"},
		{"reused pid with another start time", func(site string) provision.WorkloadRecord {
			return provision.WorkloadRecord{Site: site, Node: "a", Target: "a", Ref: "forged", State: provision.WorkloadRunning,
				Pid: pid, StartTime: start - 100, Executable: exe, BootID: strings.TrimSpace(string(boot)), Token: "0123456789abcdef0123456789abcdef", Command: exe}
		}, "is another process now"},
		{"record of another site", func(site string) provision.WorkloadRecord {
			return provision.WorkloadRecord{Site: "elsewhere", Node: "a", Target: "a", Ref: "forged", State: provision.WorkloadExited}
		}, `names site "elsewhere"`},
		{"record in another node's folder", func(site string) provision.WorkloadRecord {
			return provision.WorkloadRecord{Site: site, Node: "b", Target: "b", Ref: "forged", State: provision.WorkloadExited}
		}, `names node "b" but lies in node folder "a"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			ctx := context.Background()
			c := f.container("a", "chat", false)
			real := f.process("a", "embed")
			path := f.writeRecord("a", "forged", tt.rec(f.site))
			s := f.siteOf(cleanup.Docker, cleanup.Native)
			for name, op := range map[string]func() error{
				"cleanup":   func() error { _, err := s.Cleanup(ctx, cleanup.SiteScope(), false); return err },
				"leave":     func() error { _, err := s.Leave(ctx, false); return err },
				"reset":     func() error { _, err := s.Reset(ctx, false); return err },
				"inventory": func() error { _, err := s.Inventory(ctx, cleanup.SiteScope()); return err },
				"located": func() error {
					_, err := f.backends.LocatedWorkloads(f.layout.NodeDir("a"), f.site, "a").Cleanup(ctx)
					return err
				},
			} {
				err := op()
				if !errors.Is(err, cleanup.ErrRefused) || !strings.Contains(err.Error(), tt.why) || !strings.Contains(err.Error(), path) {
					t.Errorf("%s = %v, want ErrRefused naming %s and saying %q", name, err, path, tt.why)
				}
			}
			if !testproc.Alive(pid) || !testproc.Alive(real) || !f.exists(c.ResourceID) {
				t.Errorf("after the refusals: unrelated process %v, the site's process %v, its container %v; want all untouched", testproc.Alive(pid), testproc.Alive(real), f.exists(c.ResourceID))
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("the refused record was removed: %v", err)
			}
		})
	}
}

// TestResetDeleteLeave: the stopped-site operations, each with what it must
// leave alone.
func TestResetDeleteLeave(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	aC := f.container("a", "chat", true)
	bC := f.container("b", "chat", false)
	aP := f.process("a", "embed")
	bP := f.process("b", "embed")
	cache := func(site, node string) string {
		d := filepath.Join(f.layout.CacheRoot, site, node, "embed")
		os.MkdirAll(d, 0o700)
		os.WriteFile(filepath.Join(d, "model.gguf"), []byte("weights"), 0o600)
		return filepath.Join(f.layout.CacheRoot, site, node)
	}
	aCache, bCache, otherCache := cache(f.site, "a"), cache(f.site, "b"), cache("othersite", "a")
	putIntents := func() {
		in, err := provision.NewBoltIntents(f.lock.Store())
		if err != nil {
			t.Fatal(err)
		}
		in.PutIntent("infermesh-x-a-chat-1", provision.ProvisionSpec{AttemptID: 1, Role: "chat", Image: "x"})
	}
	intents := func() int {
		in, err := provision.NewBoltIntents(f.lock.Store())
		if err != nil {
			t.Fatal(err)
		}
		all, err := in.Intents()
		if err != nil {
			t.Fatal(err)
		}
		return len(all)
	}
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	s := f.siteOf(cleanup.Docker, cleanup.Native)

	// Without the store's lock nothing runs; a second holder is refused.
	unlocked := *s
	unlocked.Lock = nil
	if _, err := unlocked.Delete(ctx, false); !errors.Is(err, cleanup.ErrNotLocked) {
		t.Errorf("Delete without the lock = %v", err)
	}
	if _, err := cleanup.LockStore(f.layout.StateDir, 100*time.Millisecond, true); !errors.Is(err, cleanup.ErrSiteRunning) {
		t.Errorf("a second LockStore = %v, want ErrSiteRunning", err)
	}

	// A dry run finds and removes nothing.
	out, err := s.Delete(ctx, true)
	if err != nil || len(out.Found) != 4 || len(out.Removed) != 0 || !f.exists(aC.ResourceID) || !testproc.Alive(aP) {
		t.Fatalf("dry-run delete = found %v removed %v, %v", refs(out.Found), refs(out.Removed), err)
	}

	// Node a leaves: a's resources, node folder and cache; b's stay.
	putIntents()
	out, err = s.Leave(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Removed) != 2 || f.exists(aC.ResourceID) || testproc.Alive(aP) || out.Intents != 1 || intents() != 0 {
		t.Errorf("leave removed %v, intents forgotten %d", refs(out.Removed), out.Intents)
	}
	if exists(f.layout.NodeDir("a")) || exists(aCache) {
		t.Errorf("a's node folder (%v) or cache (%v) left", exists(f.layout.NodeDir("a")), exists(aCache))
	}
	if !f.exists(bC.ResourceID) || !testproc.Alive(bP) || !exists(f.layout.NodeDir("b")) || !exists(bCache) {
		t.Fatal("leave touched b's")
	}

	// Reset: every resource of the site, and the intents; the site root
	// and caches stay.
	putIntents()
	out, err = s.Reset(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Removed) != 2 || f.exists(bC.ResourceID) || testproc.Alive(bP) || intents() != 0 {
		t.Errorf("reset removed %v", refs(out.Removed))
	}
	if !exists(f.layout.SiteRoot()) || !exists(bCache) {
		t.Error("reset removed the site root or a cache")
	}

	// Delete: the site root and the site's caches; another site's cache
	// stays; twice is safe (absent counts as removed).
	for i := 0; i < 2; i++ {
		out, err = s.Delete(ctx, false)
		if err != nil {
			t.Fatalf("delete #%d: %v", i+1, err)
		}
		if exists(f.layout.SiteRoot()) || exists(filepath.Join(f.layout.CacheRoot, f.site)) {
			t.Errorf("delete #%d left the site root or cache", i+1)
		}
		if i == 1 {
			for _, p := range out.Paths {
				if !p.Absent {
					t.Errorf("second delete: %+v, want absent", p)
				}
			}
		}
	}
	if !exists(otherCache) {
		t.Error("delete removed another site's cache")
	}
}
