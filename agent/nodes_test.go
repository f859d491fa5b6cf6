package agent

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/provision/node"
)

// TestNodeConfigIsAValidAgentConfig: the config a bootstrap writes on a
// new node loads with the agent's own strict loader, and says what the
// node needs: its name and state, the mesh on its address joining this
// agent, the authority and its certificate, this agent trusted, its roles
// exposed and served to this agent.
func TestNodeConfigIsAValidAgentConfig(t *testing.T) {
	pub := identity.EncodeNodeKey(make(ed25519.PublicKey, ed25519.PublicKeySize))
	auth := identity.EncodeAuthorityKey(make(ed25519.PublicKey, ed25519.PublicKeySize))
	pc := node.PlanConfig{
		Spec: node.Spec{
			Name: "gpu-7", Run: 9,
			Roles: []node.Role{{Name: "chat", Port: 18080, Upstream: "http://127.0.0.1:18180", Model: "demo", Consumed: true}},
			Join:  []string{"10.0.0.1:7946"},
		},
		Site: "lab", Cluster: "prod", Authority: auth,
		Bootstrapper: node.Agent{Name: "hub", PublicKey: pub},
		User:         "infermesh", AdminGroup: "infermesh-admin",
	}
	data, err := node.NodeConfig(pc, "10.0.0.7")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		t.Fatalf("the node's config does not load: %v\n%s", err, data)
	}
	chat := cfg.Roles["chat"]
	for _, c := range []struct{ got, want string }{
		{cfg.Node.Name, "gpu-7"}, {cfg.Node.StateDir, node.StateDir}, {cfg.Site, "lab"}, {cfg.Mesh.Cluster, "prod"},
		{cfg.Mesh.Advertise, "10.0.0.7:7946"}, {cfg.Mesh.QUICAdvertise, "10.0.0.7:7947"},
		{strings.Join(cfg.Mesh.Join, ","), "10.0.0.1:7946"}, {cfg.Mesh.GossipKeyring, "keyring.json"},
		{cfg.Trust.Authority, auth}, {cfg.Trust.Certificate, "node.cert"},
		{fmt.Sprint(cfg.Trust.Nodes), fmt.Sprint([]TrustedNode{{Name: "hub", PublicKey: pub, Scope: "full"}})},
		{chat.Upstream, "http://127.0.0.1:18180"}, {chat.Model, "demo"}, {fmt.Sprint(chat.Port), "18080"},
		{fmt.Sprint(chat.Expose), "true"}, {strings.Join(chat.ServeTo, ","), "hub"},
		// The CLI's default socket, which the operators' group may use.
		{cfg.Admin.Socket, "/run/infermesh/admin.sock"}, {cfg.Admin.Group, "infermesh-admin"},
	} {
		if c.got != c.want {
			t.Errorf("node config: got %q, want %q\n%s", c.got, c.want, data)
		}
	}
	if _, err := cfg.MeshTrust(); err != nil {
		t.Error(err)
	}
}

func TestParseSSHTarget(t *testing.T) {
	for in, want := range map[string]string{
		"root@10.0.0.7":        "root 10.0.0.7 22",
		"ops@gpu-7.lab:2222":   "ops gpu-7.lab 2222",
		"root@[fd00::7]:22":    "root fd00::7 22",
		"10.0.0.7":             "error",
		"root@":                "error",
		"root@10.0.0.7:999999": "error",
	} {
		got := "error"
		if tgt, err := parseSSHTarget(in); err == nil {
			got = fmt.Sprintf("%s %s %d", tgt.User, tgt.Host, tgt.Port)
		}
		if got != want {
			t.Errorf("parseSSHTarget(%q) = %s, want %s", in, got, want)
		}
	}
}

// meshAgent runs an agent with a mesh on 127.0.1.x and the given trust
// section.
func meshAgent(t *testing.T, trust string) (*Agent, *admin.Client) {
	t.Helper()
	dir := t.TempDir()
	if _, err := identity.WriteNewKeyring(filepath.Join(dir, "keyring.json")); err != nil {
		t.Fatal(err)
	}
	ip := fmt.Sprintf("127.0.1.%d", 10+nextMeshIP.Add(1)%240)
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`node: {name: hub, state_dir: %s}
admin: {socket: %s}
mesh: {bind: "%s:%d", quic: "%s:%d"}
trust: %s
roles:
  chat: {port: 1}
`, dir, filepath.Join(dir, "admin.sock"), ip, testnet.TCPUDPPort(t, ip), ip, testnet.TCPUDPPort(t, ip), trust)))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Roles["chat"]
	r.Port = 0
	cfg.Roles["chat"] = r
	a := runAgent(t, cfg, Options{})
	sock, _ := a.AdminSocket()
	c := admin.NewClient(sock, admin.ClientOptions{})
	t.Cleanup(c.Close)
	return a, c
}

// TestNodeAddRefusals: what the agent refuses before anything is leased,
// each with its kind and a message that says what to do.
func TestNodeAddRefusals(t *testing.T) {
	_, authority, _ := ed25519.GenerateKey(rand.Reader)
	_, other, _ := ed25519.GenerateKey(rand.Reader)
	authPub := identity.EncodeAuthorityKey(authority.Public().(ed25519.PublicKey))
	seed := func(k ed25519.PrivateKey) string { return base64.StdEncoding.EncodeToString(k.Seed()) }
	add := func(c *admin.Client, req admin.NodeAdd) error {
		return c.AddNode(context.Background(), req, func(admin.NodeEvent) error {
			t.Error("an event was streamed for a refused add")
			return nil
		})
	}
	base := admin.NodeAdd{Name: "gpu-7", Provider: "docker", Roles: []admin.NodeRole{{Name: "chat"}}, Demo: true, AuthorityKey: seed(authority)}

	t.Run("no authority", func(t *testing.T) {
		_, c := meshAgent(t, "{}")
		err := add(c, base)
		if !errors.Is(err, admin.ErrNotConfigured) || !strings.Contains(err.Error(), "trust.authority") {
			t.Errorf("add = %v, want not configured naming trust.authority", err)
		}
	})
	_, c := meshAgent(t, fmt.Sprintf("{authority: %q}", authPub))
	for _, tc := range []struct {
		name string
		edit func(*admin.NodeAdd)
		kind error
		says string
	}{
		{"bad name", func(r *admin.NodeAdd) { r.Name = "-x" }, admin.ErrInvalid, "name"},
		{"own name", func(r *admin.NodeAdd) { r.Name = "hub" }, admin.ErrInvalid, "own name"},
		{"another authority", func(r *admin.NodeAdd) { r.AuthorityKey = seed(other) }, admin.ErrInvalid, "not the one trust.authority names"},
		{"not a key", func(r *admin.NodeAdd) { r.AuthorityKey = "x" }, admin.ErrInvalid, "authority_key"},
		{"loopback mesh", func(*admin.NodeAdd) {}, admin.ErrNotConfigured, "loopback"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := base
			tc.edit(&req)
			err := add(c, req)
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("add = %v, want %v saying %q", err, tc.kind, tc.says)
			}
		})
	}
	l, err := c.Nodes(context.Background())
	if err != nil || len(l.Nodes) != 0 || !strings.HasPrefix(l.BootstrapKey, "ssh-ed25519 ") {
		t.Errorf("nodes = %+v, %v; want none and the bootstrap key", l, err)
	}
	err = c.RemoveNode(context.Background(), "gpu-7", func(admin.NodeEvent) error { return nil })
	if !errors.Is(err, admin.ErrNotFound) {
		t.Errorf("remove of an unknown node = %v, want not found", err)
	}
	ovs, _ := c.Policy(context.Background())
	if len(ovs) != 0 {
		t.Errorf("refused adds left overrides: %+v", ovs)
	}
}
