package main

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/network"

	"github.com/infermesh/infermesh/agent"
	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/nodetest"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/provision/node"
)

// The node tests bootstrap real node containers (systemd, OpenSSH) from
// agents on this machine: an agent in this process, or infermeshd as its
// own process where the test kills it. Each test gets its own Docker
// network (the agent's mesh binds on its gateway), site and state.

var (
	binsOnce  sync.Once
	binsErr   error
	nodeImage string
	nodeBins  map[string]string // infermeshd, infermesh-demo, infermesh: static
	nodeDir   string            // removed by TestMain
	netSeq    atomic.Int32
	nodeRunID = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffff)
)

// nodeSetup finds (or builds) the node image and builds the static
// binaries the agent uploads, once per test binary.
func nodeSetup(t *testing.T) *provision.DockerClient {
	t.Helper()
	cli, tag := nodetest.Setup(t)
	nodeImage = tag
	binsOnce.Do(func() {
		if nodeDir, binsErr = os.MkdirTemp("", "infermesh-node-bins-"); binsErr != nil {
			return
		}
		nodeBins, binsErr = testbin.Build(nodeDir, "./cmd/infermeshd", "./cmd/infermesh-demo", "./cmd/infermesh")
	})
	if binsErr != nil {
		t.Fatalf("node test binaries: %v", binsErr)
	}
	return cli
}

func nodeTeardown() {
	if nodeDir != "" {
		os.RemoveAll(nodeDir)
	}
}

// nodeEnv is one test's network, site, authority and agent config.
type nodeEnv struct {
	t        *testing.T
	cli      *provision.DockerClient
	network  string
	gateway  string
	site     string
	dir      string
	authFile string
	authPub  string
	chatPort int
	// connectTimeout, when set, bounds the agent's ssh connects (the
	// default waits 90s for a booting host).
	connectTimeout time.Duration
}

func newNodeEnv(t *testing.T) *nodeEnv {
	t.Helper()
	cli := nodeSetup(t)
	n := netSeq.Add(1)
	e := &nodeEnv{t: t, cli: cli, site: fmt.Sprintf("nd%s-%d", nodeRunID, n), dir: t.TempDir()}
	e.network = "infermesh-test-" + e.site
	ctx := context.Background()
	resp, err := cli.NetworkCreate(ctx, e.network, network.CreateOptions{Driver: "bridge", Labels: map[string]string{"io.infermesh.test": e.site}})
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last in first out: the network goes after the
	// containers on it.
	t.Cleanup(func() {
		if err := cli.NetworkRemove(context.Background(), resp.ID); err != nil && !cerrdefs.IsNotFound(err) {
			t.Errorf("remove network %s: %v", e.network, err)
		}
	})
	nodetest.RemoveSiteAtCleanup(t, cli, e.site)
	info, err := cli.NetworkInspect(ctx, resp.ID, network.InspectOptions{})
	if err != nil || len(info.IPAM.Config) == 0 || info.IPAM.Config[0].Gateway == "" {
		t.Fatalf("network %s: no gateway (%v)", e.network, err)
	}
	e.gateway = info.IPAM.Config[0].Gateway
	e.authFile = filepath.Join(e.dir, "authority.key")
	key, err := identity.WriteNewKey(e.authFile)
	if err != nil {
		t.Fatal(err)
	}
	e.authPub = identity.EncodeAuthorityKey(key.Public().(ed25519.PublicKey))
	e.chatPort = testnet.TCPPort(t, "127.0.0.1")
	return e
}

func (e *nodeEnv) containers(context.Context) []container.Summary {
	return nodetest.SiteContainers(e.t, e.cli, e.site)
}

// writeAgentConfig writes the config of agent name (its state dir, a
// gossip keyring, the mesh on the network's gateway, role chat consumed
// from the mesh) and returns its path and admin socket.
func (e *nodeEnv) writeAgentConfig(name string) (cfgPath, socket string) {
	t := e.t
	state := filepath.Join(e.dir, name)
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(state, "keyring.json")); os.IsNotExist(err) {
		if _, err := identity.WriteNewKeyring(filepath.Join(state, "keyring.json")); err != nil {
			t.Fatal(err)
		}
	}
	socket = filepath.Join(state, "admin.sock")
	cfg := fmt.Sprintf(`node: {name: %s, state_dir: %s}
site: %s
admin: {socket: %s}
mesh: {bind: "%s:%d", quic: "%s:%d"}
trust: {authority: "%s"}
roles:
  chat: {port: %d}
`, name, state, e.site, socket, e.gateway, testnet.TCPUDPPort(t, e.gateway), e.gateway, testnet.TCPUDPPort(t, e.gateway), e.authPub, e.chatPort)
	cfgPath = filepath.Join(e.dir, name+".yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return cfgPath, socket
}

// startAgent runs an agent of this test in this process, with node
// bootstrap uploading the static binaries built for the test.
func (e *nodeEnv) startAgent(name string) (*agent.Agent, string) {
	t := e.t
	cfgPath, socket := e.writeAgentConfig(name)
	cfg, err := agent.LoadConfig(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(cfg, agent.Options{
		MeshTuning: func(c *mesh.Config) {
			c.GossipInterval = 50 * time.Millisecond
			c.ProbeInterval = 300 * time.Millisecond
			c.ProbeTimeout = 250 * time.Millisecond
			c.SuspicionMult = 2
		},
		NodeTuning: func(o *agent.NodeOptions) {
			o.AgentBinary, o.DemoBinary, o.CLIBinary, o.Image = nodeBins["infermeshd"], nodeBins["infermesh-demo"], nodeBins["infermesh"], nodeImage
			o.JoinTimeout = 2 * time.Minute
			o.SSH.KeepAliveInterval, o.SSH.KeepAliveTimeout = time.Second, 20*time.Second
			o.SSH.ConnectTimeout = e.connectTimeout
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent %s: %v", name, err)
		}
	})
	waitFor(t, 30*time.Second, "the agent's admin socket", func() bool {
		_, ok := a.AdminSocket()
		return ok
	})
	return a, socket
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, timeout, cond)
}

// nodeEvents parses an NDJSON node stream.
func nodeEvents(t *testing.T, out string) []admin.NodeEvent {
	t.Helper()
	var evs []admin.NodeEvent
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if l == "" {
			continue
		}
		var e admin.NodeEvent
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatalf("stream line %q: %v", l, err)
		}
		evs = append(evs, e)
	}
	return evs
}

func nodeList(t *testing.T, socket string) admin.NodeList {
	t.Helper()
	out, errOut, code := runCLI(t, "node", "list", "--json", "--socket", socket)
	if code != 0 {
		t.Fatalf("node list: exit %d: %s", code, errOut)
	}
	var l admin.NodeList
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		t.Fatal(err)
	}
	return l
}

func member(m *mesh.Mesh, name string) (mesh.PeerInfo, bool) {
	for _, p := range m.Members() {
		if p.Name == name {
			return p, true
		}
	}
	return mesh.PeerInfo{}, false
}

// assertGone checks that nothing of node name is left: no container, no
// record, no accept_from override, and (once gossip caught up) no member.
func (e *nodeEnv) assertGone(a *agent.Agent, socket, name string) {
	t := e.t
	t.Helper()
	for _, c := range e.containers(context.Background()) {
		if c.Labels[node.LabelKind] == node.KindNodeValue && c.Labels[provision.LabelNode] == name {
			t.Errorf("node container %s of %s is left", c.Names, name)
		}
	}
	for _, n := range nodeList(t, socket).Nodes {
		if n.Name == name {
			t.Errorf("node %s is still recorded: %+v", name, n)
		}
	}
	out, _, _ := runCLI(t, "policy", "list", "--json", "--socket", socket)
	if strings.Contains(out, `"node": "`+name+`"`) {
		t.Errorf("an override for %s is left:\n%s", name, out)
	}
	if a != nil {
		waitFor(t, 30*time.Second, name+" gone from the mesh view", func() bool {
			_, ok := member(a.Mesh(), name)
			return !ok
		})
	}
}
