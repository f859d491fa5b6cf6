package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/image"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/internal/testing/testimage"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/provision"
)

// Static builds of the demo model and this CLI, made once, in a directory
// every user may read (the root-owned data test runs the CLI as nobody).
var bins = &testbin.Lazy{Pkgs: []string{"./cmd/infermesh-demo", "./cmd/infermesh", "./cmd/infermeshd"}}

func staticBins(t *testing.T) map[string]string { return bins.Get(t) }

var siteRun = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)

// siteEnv is one site's config file and directories.
type siteEnv struct {
	site, config, stateDir, cacheDir, socket string
}

// newSiteEnv writes a config for site with the given roles (YAML lines
// under roles:), in directories under dir.
func newSiteEnv(t *testing.T, dir, name, roles string) siteEnv {
	t.Helper()
	e := siteEnv{
		site:     fmt.Sprintf("cli%s-%s", siteRun, name),
		config:   filepath.Join(dir, "infermesh.yaml"),
		stateDir: filepath.Join(dir, "state"),
		cacheDir: filepath.Join(dir, "cache"),
		socket:   filepath.Join(dir, "admin.sock"),
	}
	cfg := fmt.Sprintf("site: %s\nnode: {name: a, state_dir: %s, cache_dir: %s}\nadmin: {socket: %s}\nroles:\n%s", e.site, e.stateDir, e.cacheDir, e.socket, roles)
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestSiteCommands drives every stopped-site command against what a real
// agent left running: a native instance it started, and containers of this
// node and another on the real engine.
func TestSiteCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("runs containers on the Docker engine and real processes; skipped in -short mode only")
	}
	bins := staticBins(t)
	tag := fmt.Sprintf("%s-cli-%s", testimage.Tag, siteRun)
	root, _ := filepath.Abs("../..")
	if err := testimage.Build(root, tag); err != nil {
		t.Fatal(err)
	}
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cli.ImageRemove(ctx, tag, image.RemoveOptions{PruneChildren: true})
		cli.Close()
	})
	port := testnet.TCPPort(t, "127.0.0.1")
	e := newSiteEnv(t, t.TempDir(), "cmds", fmt.Sprintf(
		"  chat: {port: %d, model: m, instance: {runtime: native, command: %s, args: [-listen, 127.0.0.1:%d, -model, m], port: %d}}\n",
		testnet.TCPPort(t, "127.0.0.1"), bins["infermesh-demo"], port, port))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		list, _ := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+e.site))})
		for _, c := range list {
			cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true})
		}
	})
	containerOf := func(node string) string {
		p, err := provision.NewDockerProvider(cli, provision.DockerConfig{Site: e.site, Node: node})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		h, err := p.CreateInstance(context.Background(), provision.ProvisionSpec{AttemptID: 1, Role: "embed", Image: tag, Ports: []int{8080}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return h.ResourceID
	}
	exists := func(id string) bool {
		_, err := cli.ContainerInspect(context.Background(), id)
		if err != nil && !cerrdefs.IsNotFound(err) {
			t.Fatal(err)
		}
		return err == nil
	}
	aC, bC := containerOf("a"), containerOf("b")

	_, stop := startRealAgent(t, e.config)
	testproc.WaitUntil(t, "the native instance to answer", time.Minute, func() bool { return testproc.Healthy(port) })

	// While the agent runs, every command refuses and says so.
	for _, args := range [][]string{{"site", "inventory"}, {"site", "cleanup"}, {"site", "delete"}, {"node", "leave"}} {
		_, errOut, code := runCLI(t, append(args, "--config", e.config)...)
		if code == 0 || !strings.Contains(errOut, "the agent is running") || !strings.Contains(errOut, e.socket) {
			t.Errorf("%v while the agent runs: exit %d, %q; want a refusal naming its socket", args, code, errOut)
		}
	}
	stop()
	if !testproc.Healthy(port) {
		t.Fatal("the native instance did not outlive the agent")
	}

	out, errOut, code := runCLI(t, "site", "inventory", "--config", e.config)
	if code != 0 {
		t.Fatalf("inventory: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"site " + e.site + " on node a, scope site", "Docker runtime:", "native runtime:",
		"infermesh-" + e.site + "-a-embed-1", "infermesh-" + e.site + "-b-embed-1", "infermesh-" + e.site + "-a-chat-1", "running"} {
		if !strings.Contains(out, want) {
			t.Errorf("inventory does not say %q:\n%s", want, out)
		}
	}
	out, _, code = runCLI(t, "site", "inventory", "--config", e.config, "--targets", "b", "--json")
	var inv cleanup.Inventory
	if code != 0 || json.Unmarshal([]byte(out), &inv) != nil || len(inv.Resources) != 1 || inv.Resources[0].Target != "b" {
		t.Errorf("inventory --targets b --json = exit %d, %s", code, out)
	}

	out, _, code = runCLI(t, "site", "cleanup", "--config", e.config, "--dry-run")
	if code != 0 || !strings.Contains(out, "dry run") || !exists(aC) || !testproc.Healthy(port) {
		t.Errorf("cleanup --dry-run: exit %d, removed something?\n%s", code, out)
	}

	// Node a leaves: its container and process; b's container stays.
	out, errOut, code = runCLI(t, "node", "leave", "--config", e.config)
	if code != 0 {
		t.Fatalf("node leave: exit %d: %s\n%s", code, errOut, out)
	}
	if exists(aC) || testproc.Healthy(port) || !exists(bC) {
		t.Errorf("after node leave: a's container %v, process answering %v, b's container %v", exists(aC), testproc.Healthy(port), exists(bC))
	}
	if !strings.Contains(out, "removed:") || !strings.Contains(out, "node folder") {
		t.Errorf("node leave does not say what it did:\n%s", out)
	}

	out, errOut, code = runCLI(t, "site", "delete", "--config", e.config, "--json")
	var o cleanup.Outcome
	if code != 0 || json.Unmarshal([]byte(out), &o) != nil {
		t.Fatalf("delete: exit %d: %s\n%s", code, errOut, out)
	}
	if len(o.Removed) != 1 || o.Removed[0].Target != "b" || exists(bC) {
		t.Errorf("delete removed %+v", o.Removed)
	}
	if _, err := os.Stat(filepath.Join(e.stateDir, "sites", e.site)); !os.IsNotExist(err) {
		t.Errorf("site root left: %v", err)
	}
	out, _, code = runCLI(t, "site", "delete", "--config", e.config)
	if code != 0 || !strings.Contains(out, "already absent") {
		t.Errorf("second delete: exit %d\n%s", code, out)
	}
}

// TestSiteRefusals: an unknown binding, an unreadable config without a
// site, a store another process holds, and an unreachable Docker daemon
// that an unreadable config binds.
func TestSiteRefusals(t *testing.T) {
	dir := t.TempDir()
	unknown := newSiteEnv(t, dir, "u", "  chat: {port: 1, instance: {runtime: futureRuntime, image: x}}\n")
	_, errOut, code := runCLI(t, "site", "cleanup", "--config", unknown.config)
	if code == 0 || !strings.Contains(errOut, `binds unknown runtime adapter "futureRuntime"`) {
		t.Errorf("unknown binding: exit %d, %q", code, errOut)
	}

	garbage := filepath.Join(dir, "garbage.yaml")
	os.WriteFile(garbage, []byte("{{{ not yaml"), 0o600)
	_, errOut, code = runCLI(t, "site", "cleanup", "--config", garbage)
	if code == 0 || !strings.Contains(errOut, "--site") {
		t.Errorf("unreadable config without --site: exit %d, %q", code, errOut)
	}

	// Unreadable: every runtime bound, so a dead Docker daemon fails it.
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(dir, "dead.sock"))
	state := filepath.Join(dir, "state")
	_, errOut, code = runCLI(t, "site", "cleanup", "--config", garbage, "--site", "cli"+siteRun+"-g", "--node", "a",
		"--state-dir", state, "--cache-dir", filepath.Join(dir, "cache"))
	dead := "unix://" + filepath.Join(dir, "dead.sock")
	if want := "infermesh: Docker runtime is bound by the site's configuration: list containers of site cli" + siteRun + "-g: docker daemon unreachable: " +
		dead + ": Cannot connect to the Docker daemon at " + dead + ". Is the docker daemon running?\n"; code == 0 || !strings.HasSuffix(errOut, want) {
		t.Errorf("unreadable config, dead daemon: exit %d, %q\nwant it to end with %q", code, errOut, want)
	}

	// A store another process holds: the agent (or another cleanup) runs.
	lock, err := cleanup.LockStore(state, time.Second, true)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	_, errOut, code = runCLI(t, "site", "reset", "--config", garbage, "--site", "cli"+siteRun+"-g", "--node", "a", "--state-dir", state, "--cache-dir", filepath.Join(dir, "cache"))
	if code == 0 || !strings.Contains(errOut, "the agent is running") || !strings.Contains(errOut, "locked") {
		t.Errorf("locked store: exit %d, %q", code, errOut)
	}
}

// TestSiteDeleteRootOwnedData: the CLI run as an unprivileged user (with
// access to the Docker socket) deletes a site root holding data left owned
// by root, through a helper container.
func TestSiteDeleteRootOwnedData(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a helper container on the Docker engine; skipped in -short mode only")
	}
	if os.Getuid() != 0 {
		t.Fatal("this test makes root-owned data and runs the CLI as another user: it needs root")
	}
	bins := staticBins(t)
	var sock syscall.Stat_t
	if err := syscall.Stat("/var/run/docker.sock", &sock); err != nil {
		t.Fatalf("the Docker socket: %v", err)
	}
	const nobody = 65534
	dir, err := os.MkdirTemp("", "infermesh-rootowned-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e := newSiteEnv(t, dir, "root", "")
	for _, d := range []string{dir, e.stateDir, e.cacheDir} {
		os.MkdirAll(d, 0o700)
		os.Chown(d, nobody, nobody)
	}
	os.Chown(e.config, nobody, nobody)
	// The site root belongs to the agent's user; inside it, what a
	// container running as root wrote.
	siteRoot := filepath.Join(e.stateDir, "sites", e.site)
	data := filepath.Join(siteRoot, "nodes", "a", "models")
	os.MkdirAll(data, 0o755)
	for _, d := range []string{filepath.Join(e.stateDir, "sites"), siteRoot, filepath.Join(siteRoot, "nodes"), filepath.Join(siteRoot, "nodes", "a")} {
		os.Chown(d, nobody, nobody)
	}
	os.WriteFile(filepath.Join(data, "weights.bin"), []byte("root's"), 0o600) // root-owned, in a root-owned directory

	cmd := exec.Command(bins["infermesh"], "site", "delete", "--config", e.config)
	cmd.Env = append(os.Environ(), "HOME="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody, Groups: []uint32{sock.Gid}}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("site delete as uid %d: %v\n%s", nobody, err, out)
	}
	if !strings.Contains(string(out), "root-owned data through a helper container") {
		t.Errorf("site delete does not say it removed root-owned data:\n%s", out)
	}
	if _, err := os.Stat(siteRoot); !os.IsNotExist(err) {
		t.Errorf("site root left: %v", err)
	}
	// The helper left nothing behind.
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	list, _ := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+e.site))})
	imgs, _ := testimage.Engine(t).ImageList(context.Background(), image.ListOptions{Filters: filters.NewArgs(filters.Arg("reference", "infermesh-cleanup-helper"))})
	if len(list) != 0 || len(imgs) != 0 {
		t.Errorf("helper left %d containers and %d images", len(list), len(imgs))
	}
}
