package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/provision"
)

// Static builds of the agent and the demo model, made once.
var bins = &testbin.Lazy{Pkgs: []string{"./cmd/infermeshd", "./cmd/infermesh-demo"}}

func staticBins(t *testing.T) map[string]string { return bins.Get(t) }

// agentProc is infermeshd run as its own process.
type agentProc struct {
	cmd *exec.Cmd
	out *bytes.Buffer
}

func startAgentProc(t *testing.T, bin, config string) *agentProc {
	t.Helper()
	p := &agentProc{cmd: exec.Command(bin, "-config", config), out: &bytes.Buffer{}}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
			p.cmd.Wait()
		}
	})
	return p
}

// instance polls the agent's admin socket until role's instance satisfies
// pred.
func instanceWhen(t *testing.T, c *admin.Client, role string, pred func(admin.Instance) bool) admin.Instance {
	t.Helper()
	var last admin.Instance
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		is, err := c.Instances(ctx)
		cancel()
		if err == nil {
			for _, i := range is {
				if i.Role == role {
					last = i
					if pred(i) {
						return i
					}
				}
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("instance %s: last %+v", role, last)
	return last
}

// workloadProcesses counts the live processes that carry ref as their
// workload.
func workloadProcesses(ref string) int {
	ents, _ := os.ReadDir("/proc")
	n := 0
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		if err != nil || !bytes.Contains(env, []byte("INFERMESH_WORKLOAD="+ref+"\x00")) {
			continue
		}
		stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if i := bytes.LastIndexByte(stat, ')'); i > 0 && stat[i+2] != 'Z' {
			n++
		}
	}
	return n
}

// nativeAgentConfig writes the config of an agent (node a of a new site
// named after prefix) whose role chat is a native demo instance, with
// extra appended to its instance fields; the site is deleted at cleanup.
func nativeAgentConfig(t *testing.T, b map[string]string, prefix, extra string) (config, sock, site string, port, rolePort int) {
	t.Helper()
	dir := t.TempDir()
	port, rolePort = testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1")
	site = fmt.Sprintf("%s%x", prefix, time.Now().UnixNano()&0xffffff)
	sock = filepath.Join(dir, "admin.sock")
	config = filepath.Join(dir, "infermesh.yaml")
	os.WriteFile(config, []byte(fmt.Sprintf(`site: %s
node: {name: a, state_dir: %s/state, cache_dir: %s/cache}
admin: {socket: %s}
log: {level: warn}
roles:
  chat:
    port: %d
    model: m
    instance: {runtime: native, command: %s, args: [-listen, "127.0.0.1:%d", -model, m], port: %d%s}
`, site, dir, dir, sock, rolePort, b["infermesh-demo"], port, port, extra)), 0o600)
	layout := cleanup.Layout{StateDir: dir + "/state", CacheRoot: dir + "/cache", Site: site}
	t.Cleanup(func() { deleteSite(t, layout, "a") })
	return config, sock, site, port, rolePort
}

// TestNativeInstanceSurvivesAgentKill: the agent runs as its own process
// and is killed with SIGKILL. Its native instance runs on, answering all
// along; the restarted agent adopts it (the same pid, not restarted, no
// second process) and serves through it again.
func TestNativeInstanceSurvivesAgentKill(t *testing.T) {
	b := staticBins(t)
	config, sock, site, port, rolePort := nativeAgentConfig(t, b, "agentkill", "")

	c := admin.NewClient(sock, admin.ClientOptions{Wait: 10 * time.Second})
	defer c.Close()
	first := startAgentProc(t, b["infermeshd"], config)
	ready := func(i admin.Instance) bool { return i.State == "ready" && i.PID > 0 }
	inst := instanceWhen(t, c, "chat", ready)
	pid := inst.PID
	if inst.Runtime != "native" || inst.Ref != "infermesh-"+site+"-a-chat-1" {
		t.Fatalf("instance = %+v", inst)
	}

	// Probe the instance itself all through the agent's death and restart.
	var probes, failures atomic.Int64
	stopProbe := make(chan struct{})
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		for {
			select {
			case <-stopProbe:
				return
			default:
			}
			probes.Add(1)
			if !testproc.Healthy(port) {
				failures.Add(1)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()

	waitFor(t, "probes before the kill", func() bool { return probes.Load() >= 5 })
	if err := first.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	first.cmd.Wait()
	killed := time.Now()
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
		t.Fatalf("the native instance died with the agent: %v", err)
	}

	startAgentProc(t, b["infermeshd"], config)
	inst = instanceWhen(t, c, "chat", ready)
	t.Logf("from the kill to the instance adopted and ready: %v", time.Since(killed).Round(time.Millisecond))
	if inst.PID != pid || inst.Restarts != 0 {
		t.Errorf("after the restart: pid %d, %d restarts; want pid %d adopted, not restarted", inst.PID, inst.Restarts, pid)
	}
	if n := workloadProcesses(inst.Ref); n != 1 {
		t.Errorf("%d processes carry the workload, want 1 (no duplicate)", n)
	}
	logs, err := c.InstanceLogs(context.Background(), "chat", 0)
	if err != nil {
		t.Fatal(err)
	}
	adopted := false
	for _, l := range logs {
		adopted = adopted || strings.Contains(l.Line, fmt.Sprintf("adopted running process %d", pid))
	}
	if !adopted {
		t.Errorf("logs do not say the process was adopted: %+v", logs)
	}
	// Served through the agent again.
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", rolePort), "application/json",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("chat through the restarted agent: %s", resp.Status)
	}
	after := probes.Load()
	waitFor(t, "probes after the adoption", func() bool { return probes.Load() >= after+5 })
	close(stopProbe)
	<-probed
	if f := failures.Load(); f != 0 {
		t.Errorf("the instance failed %d of %d probes across the agent's restart, want none", f, probes.Load())
	}
	t.Logf("%d probes of the instance across the restart, %d failed", probes.Load(), failures.Load())
}

// TestAgentSweepsNativeOrphans: the agent's periodic sweep removes a native
// process of its own node and site that nothing wants, and leaves its own
// instance and another node's process alone.
func TestAgentSweepsNativeOrphans(t *testing.T) {
	b := staticBins(t)
	dir := t.TempDir()
	site := fmt.Sprintf("agentsweep%x", time.Now().UnixNano()&0xffffff)
	layout := cleanup.Layout{StateDir: dir + "/state", CacheRoot: dir + "/cache", Site: site}
	t.Cleanup(func() { deleteSite(t, layout, "a") })
	ctx := context.Background()
	orphan := func(node string) (provision.ProvisionSpec, int) {
		p, err := provision.NewNativeProvider(provision.NativeConfig{Site: site, Node: node, Dir: layout.NodeDir(node), CacheDir: layout.NodeCache(node)})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		port := testnet.TCPPort(t, "127.0.0.1")
		spec := provision.ProvisionSpec{AttemptID: 1, Role: "old", Runtime: provision.RuntimeNative, Command: b["infermesh-demo"],
			Args: []string{"-listen", "127.0.0.1:" + strconv.Itoa(port)}, Ports: []int{port}}
		h, err := p.CreateInstance(ctx, spec, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.StartInstance(ctx, h); err != nil {
			t.Fatal(err)
		}
		st, _ := p.Status(ctx, h.Ref)
		return spec, st.Pid
	}
	_, mine := orphan("a")
	_, theirs := orphan("b")

	port := testnet.TCPPort(t, "127.0.0.1")
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`site: %s
node: {name: a, state_dir: %s, cache_dir: %s}
admin: {socket: %s/admin.sock}
roles:
  chat: {port: %d, model: m, instance: {runtime: native, command: %s, args: [-listen, "127.0.0.1:%d", -model, m], port: %d}}
`, site, layout.StateDir, layout.CacheRoot, dir, testnet.TCPPort(t, "127.0.0.1"), b["infermesh-demo"], port, port)))
	if err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, cfg, Options{
		ProvisionTuning: func(c *provision.ManagerConfig) { c.ProbeInterval = 100 * time.Millisecond },
		SweepTuning: func(c *cleanup.SweeperConfig) {
			c.Grace, c.Interval, c.RetryBackoff = time.Nanosecond, 200*time.Millisecond, 50*time.Millisecond
		},
	})
	gone := func(pid int) bool {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return true
		}
		i := bytes.LastIndexByte(stat, ')')
		return stat[i+2] == 'Z'
	}
	waitFor(t, "the orphan to be swept", func() bool { return gone(mine) })
	waitFor(t, "the wanted instance to serve", func() bool { return len(a.Table().Resolve("chat")) == 1 })
	if gone(theirs) {
		t.Error("the sweep stopped another node's process")
	}
	// The event is recorded once the sweep is over, just after the stop.
	waitFor(t, "a cleanup.orphan_removed event", func() bool {
		for _, e := range a.Audit().Recent() {
			if e.Kind == "cleanup.orphan_removed" && strings.Contains(e.Fields["ref"], "-a-old-1") {
				return true
			}
		}
		return false
	})
}

// deleteSite removes what a test's site left on this host, the way
// `infermesh site delete` does (every node folder's processes included).
func deleteSite(t *testing.T, l cleanup.Layout, node string) {
	t.Helper()
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Error(err)
		return
	}
	defer cli.Close()
	b, err := provision.NewSiteCleanups(provision.SiteCleanupsConfig{Docker: cli, Layout: l, Node: node})
	if err != nil {
		t.Error(err)
		return
	}
	lock, err := cleanup.LockStore(l.StateDir, 30*time.Second, true)
	if err != nil {
		t.Error(err)
		return
	}
	defer lock.Close()
	s := &cleanup.Site{Name: l.Site, Node: node, Layout: l, Bound: cleanup.NewKindSet(cleanup.Native), Backends: b, Lock: lock}
	if _, err := s.Delete(context.Background(), false); err != nil {
		t.Errorf("deleting the test site: %v", err)
	}
}

// TestSimulatedInstance: a role whose instance is simulated is served by the
// built-in demo model inside the agent, pinned to the role's model; nothing
// is provisioned for it.
func TestSimulatedInstance(t *testing.T) {
	dir := t.TempDir()
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`node: {name: a, state_dir: %s, cache_dir: %s/cache}
admin: {socket: %s/admin.sock}
roles:
  chat: {port: %d, model: tiny, instance: {runtime: simulated}}
`, dir, dir, dir, testnet.TCPPort(t, "127.0.0.1"))))
	if err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, cfg, Options{Simulated: demoDevModel})
	waitFor(t, "the simulated instance to register", func() bool { return len(a.Table().Resolve("chat")) == 1 })
	if c := a.Table().Resolve("chat")[0]; c.Model != "tiny" {
		t.Errorf("candidate = %+v, want model tiny", c)
	}
	addr, _ := a.RoleAddr("chat")
	resp, err := http.Post("http://"+addr.String()+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("chat: %s", resp.Status)
	}
	if _, err := os.Stat(filepath.Join(dir, "sites")); !os.IsNotExist(err) {
		t.Errorf("a simulated instance made a site root: %v", err)
	}
}

// TestSimulatedInstanceWithoutModel: `instance: {runtime: simulated}` with
// no model, as docs/operations.md shows it, serves every name the role port lists
// in /v1/models, and the demo model's own name: the role's model and the
// simulated instance's are the same ("demo").
func TestSimulatedInstanceWithoutModel(t *testing.T) {
	dir := t.TempDir()
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`node: {name: a, state_dir: %s, cache_dir: %s/cache}
admin: {socket: %s/admin.sock}
roles:
  sim: {port: %d, instance: {runtime: simulated}}
`, dir, dir, dir, testnet.TCPPort(t, "127.0.0.1"))))
	if err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, cfg, Options{Simulated: demoDevModel})
	waitFor(t, "the simulated instance to register", func() bool { return len(a.Table().Resolve("sim")) == 1 })
	addr, _ := a.RoleAddr("sim")
	base := "http://" + addr.String()
	resp, err := http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{}
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if want := []string{"sim", "demo"}; !slices.Equal(ids, want) {
		t.Errorf("/v1/models lists %v, want %v", ids, want)
	}
	for _, model := range append(ids, "demo") {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"model":"`+model+`"`) {
			t.Errorf("model %q: %s %s, want 200 answered as %q", model, resp.Status, body, model)
		}
	}
}

// TestInstancesStopWithTheAgentOrTheOperator: with stop_with_agent the
// instance stops when the agent does (SIGTERM); `instances stop` stops one
// at once, and it stays stopped until `instances retry`.
func TestInstancesStopWithTheAgentOrTheOperator(t *testing.T) {
	b := staticBins(t)
	config, sock, _, _, _ := nativeAgentConfig(t, b, "agentstop", ", stop_with_agent: true")
	c := admin.NewClient(sock, admin.ClientOptions{Wait: 10 * time.Second})
	defer c.Close()
	ag := startAgentProc(t, b["infermeshd"], config)
	ready := func(i admin.Instance) bool { return i.State == "ready" && i.PID > 0 }
	pid := instanceWhen(t, c, "chat", ready).PID

	// The operator stops it: gone at once, and it stays stopped.
	st, err := c.StopInstance(context.Background(), "chat")
	if err != nil {
		t.Fatal(err)
	}
	if st.State != "stopped" || testproc.Alive(pid) {
		t.Fatalf("after instances stop: %+v, process %d alive %v", st, pid, testproc.Alive(pid))
	}
	if _, err := c.RetryInstance(context.Background(), "chat"); err != nil {
		t.Fatal(err)
	}
	pid = instanceWhen(t, c, "chat", func(i admin.Instance) bool { return ready(i) && i.PID != pid }).PID

	// The agent stops: with stop_with_agent, so does the instance.
	if err := ag.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := ag.cmd.Wait(); err != nil {
		t.Fatalf("agent exit: %v\n%s", err, ag.out)
	}
	if testproc.Alive(pid) {
		t.Errorf("process %d outlived the agent despite stop_with_agent", pid)
	}
}
