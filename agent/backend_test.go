package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/mesh"
)

// adminConfigFile writes a config with role chat (and its policy lines) to
// dir and loads it.
func adminConfigFile(t *testing.T, dir, policy string, port int) *Config {
	t.Helper()
	path := filepath.Join(dir, "infermesh.yaml")
	text := fmt.Sprintf(`
node: {name: a, state_dir: %s}
admin: {socket: %s}
trust: {revoked: [evil]}
roles:
  chat:
    port: %d
    model: demo
%s
`, filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock"), port, policy)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

const basePolicy = `    expose: true
    serve_to: [b]
    accept_from: [b, c]`

// adminAgent is a running agent with its admin runtime served.
type adminAgent struct {
	a      *Agent
	ad     *Admin
	client *admin.Client
	stop   func()
}

// startAdminAgent runs a real agent on cfg; Run opens and serves its admin
// socket. The non-nil fields of opts replace the agent's own.
func startAdminAgent(t *testing.T, cfg *Config, opts AdminOptions) *adminAgent {
	t.Helper()
	return startAdminAgentWith(t, cfg, Options{}, opts)
}

// startAdminAgentWith is startAdminAgent with the agent's options o (its
// AdminTuning is replaced).
func startAdminAgentWith(t *testing.T, cfg *Config, o Options, opts AdminOptions) *adminAgent {
	t.Helper()
	o.AdminTuning = func(o *AdminOptions) {
		if opts.Mesh != nil {
			o.Mesh = opts.Mesh
		}
		if opts.Instances != nil {
			o.Instances = opts.Instances
		}
		if opts.Metrics != nil {
			o.Metrics = opts.Metrics
		}
		for class, p := range opts.parts {
			o.parts[class] = p
		}
		if opts.StoreLockTimeout != 0 {
			o.StoreLockTimeout = opts.StoreLockTimeout
		}
	}
	a, err := New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	waitFor(t, "the admin socket", func() bool {
		select {
		case err := <-done:
			t.Fatalf("Run: %v", err)
		default:
		}
		_, ok := a.AdminSocket()
		_, ok2 := a.RoleAddr("chat")
		return ok && ok2
	})
	a.mu.Lock()
	ad := a.admin
	a.mu.Unlock()
	c := admin.NewClient(cfg.Admin.Socket, admin.ClientOptions{})
	var once sync.Once
	aa := &adminAgent{a: a, ad: ad, client: c}
	aa.stop = func() {
		once.Do(func() {
			c.Close()
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(aa.stop)
	return aa
}

type policyState struct {
	exposed    bool
	serveTo    []string
	acceptFrom []string
}

func tablePolicy(a *Agent) policyState {
	s := a.Table().Snapshot()
	return policyState{
		exposed:    slices.Contains(s.Exposed, "chat"),
		serveTo:    s.Serve["chat"],
		acceptFrom: s.Allow["chat"],
	}
}

func (p policyState) String() string {
	return fmt.Sprintf("exposed=%v serve_to=%v accept_from=%v", p.exposed, p.serveTo, p.acceptFrom)
}

func TestPolicyOverridesSurviveRestartAndReset(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	aa := startAdminAgent(t, cfg, AdminOptions{})
	ctx := context.Background()

	if got, want := tablePolicy(aa.a).String(), "exposed=true serve_to=[b] accept_from=[b c]"; got != want {
		t.Fatalf("config policy = %s, want %s", got, want)
	}
	changes := []admin.PolicyChange{
		{Kind: admin.KindAcceptFrom, Role: "chat", Node: "c", On: false}, // deny a config entry
		{Kind: admin.KindAcceptFrom, Role: "chat", Node: "d", On: true},  // allow a new one
		{Kind: admin.KindServeTo, Role: "chat", Node: "b", On: false},
		{Kind: admin.KindServeTo, Role: "chat", Node: "e", On: true},
		{Kind: admin.KindExpose, Role: "chat", On: false},
	}
	for _, c := range changes {
		res, err := aa.client.SetPolicy(ctx, c)
		if err != nil || !res.Changed {
			t.Fatalf("SetPolicy(%+v) = %+v, %v; want a change", c, res, err)
		}
		if !strings.HasPrefix(res.Override.By, "uid 0 ") {
			t.Errorf("override by %q, want the kernel-verified uid 0", res.Override.By)
		}
	}
	want := "exposed=false serve_to=[e] accept_from=[b d]"
	if got := tablePolicy(aa.a).String(); got != want {
		t.Fatalf("after changes: %s, want %s", got, want)
	}
	// Setting the same thing again changes nothing.
	if res, err := aa.client.SetPolicy(ctx, changes[0]); err != nil || res.Changed {
		t.Errorf("repeated SetPolicy = %+v, %v; want no change", res, err)
	}

	roles, err := aa.client.Roles(ctx)
	if err != nil || len(roles) != 1 {
		t.Fatalf("Roles() = %+v, %v", roles, err)
	}
	var srcs []string
	for _, r := range roles[0].AcceptFrom {
		srcs = append(srcs, fmt.Sprintf("%s:%v:%s", r.Node, r.On, r.Source))
	}
	if got, want := strings.Join(srcs, " "), "b:true:config c:false:runtime d:true:runtime"; got != want {
		t.Errorf("accept_from rules = %s, want %s", got, want)
	}
	if e := roles[0].Expose; e.On || e.Source != admin.SourceRuntime || e.At == nil {
		t.Errorf("expose rule = %+v, want off from runtime with a time", e)
	}

	// Restart: the overrides are applied on top of the config again.
	aa.stop()
	aa = startAdminAgent(t, cfg, AdminOptions{})
	if got := tablePolicy(aa.a).String(); got != want {
		t.Fatalf("after restart: %s, want %s", got, want)
	}
	st, err := aa.client.Status(ctx)
	if err != nil || st.Overrides != 5 {
		t.Errorf("Status().Overrides = %d, %v; want 5", st.Overrides, err)
	}

	// Reset one role's serving side, then everything: the config again.
	res, err := aa.client.ResetPolicy(ctx, admin.PolicyFilter{Kind: admin.KindServeTo, Role: "chat"})
	if err != nil || len(res.Removed) != 2 {
		t.Fatalf("ResetPolicy(serve_to) = %+v, %v; want 2 removed", res, err)
	}
	if got, want := tablePolicy(aa.a).String(), "exposed=false serve_to=[b] accept_from=[b d]"; got != want {
		t.Errorf("after serve_to reset: %s, want %s", got, want)
	}
	if _, err := aa.client.ResetPolicy(ctx, admin.PolicyFilter{}); err != nil {
		t.Fatal(err)
	}
	if got, want := tablePolicy(aa.a).String(), "exposed=true serve_to=[b] accept_from=[b c]"; got != want {
		t.Errorf("after reset: %s, want the config's %s", got, want)
	}
}

func TestPolicyRefusals(t *testing.T) {
	dir := t.TempDir()
	aa := startAdminAgent(t, adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1")), AdminOptions{})
	ctx := context.Background()
	tests := []struct {
		name string
		c    admin.PolicyChange
		want error
	}{
		{"unknown role", admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "embed", Node: "b", On: true}, admin.ErrNotFound},
		{"bad role", admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "a/b", Node: "b", On: true}, admin.ErrInvalid},
		{"bad node", admin.PolicyChange{Kind: admin.KindServeTo, Role: "chat", Node: "no such", On: true}, admin.ErrInvalid},
		{"self", admin.PolicyChange{Kind: admin.KindServeTo, Role: "chat", Node: "a", On: true}, admin.ErrInvalid},
		{"expose with node", admin.PolicyChange{Kind: admin.KindExpose, Role: "chat", Node: "b", On: true}, admin.ErrInvalid},
		{"unknown kind", admin.PolicyChange{Kind: "deny_all", Role: "chat", On: true}, admin.ErrInvalid},
		{"revoke with role", admin.PolicyChange{Kind: admin.KindRevoke, Role: "chat", Node: "b", On: true}, admin.ErrInvalid},
		{"unrevoke config", admin.PolicyChange{Kind: admin.KindRevoke, Node: "evil", On: false}, admin.ErrConflict},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := aa.client.SetPolicy(ctx, tt.c); !errors.Is(err, tt.want) {
				t.Errorf("SetPolicy(%+v) = %v, want %v", tt.c, err, tt.want)
			}
		})
	}
	if ovs, _ := aa.client.Policy(ctx); len(ovs) != 0 {
		t.Errorf("refused changes were stored: %+v", ovs)
	}
}

func TestReloadAppliesPolicyKeepsOverrides(t *testing.T) {
	dir := t.TempDir()
	port := testnet.TCPPort(t, "127.0.0.1")
	cfg := adminConfigFile(t, dir, basePolicy, port)
	aa := startAdminAgent(t, cfg, AdminOptions{})
	ctx := context.Background()
	if _, err := aa.client.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "chat", Node: "c", On: false}); err != nil {
		t.Fatal(err)
	}
	// The new file: c and d may serve chat to us, b no longer; serving
	// side unchanged; and a log level (it needs a restart).
	writeNext := func(logLine string) {
		t.Helper()
		adminConfigFile(t, dir, `    expose: true
    serve_to: [b]
    accept_from: [c, d]`, port)
		f, err := os.OpenFile(cfg.Path(), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteString(logLine); err != nil {
			t.Fatal(err)
		}
	}
	writeNext("log: {level: debug}\n")
	res, err := aa.client.Reload(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(res.Applied, "|"), "roles.chat.accept_from: +d -b"; got != want {
		t.Errorf("Applied = %q, want %q", got, want)
	}
	if got, want := strings.Join(res.NeedsRestart, "|"), `log.level: "" -> "debug"`; got != want {
		t.Errorf("NeedsRestart = %q, want %q", got, want)
	}
	// c stays denied by the run-time override, whatever the file says.
	if got, want := tablePolicy(aa.a).String(), "exposed=true serve_to=[b] accept_from=[d]"; got != want {
		t.Errorf("after reload: %s, want %s", got, want)
	}
	// Reload compares the file with what runs, not with the last file
	// read: the level still waits for a restart, and once the file says
	// the running level again, nothing does.
	if res, err = aa.client.Reload(ctx); err != nil || strings.Join(res.NeedsRestart, "|") != `log.level: "" -> "debug"` || len(res.Applied) != 0 {
		t.Errorf("second reload of the same file = %+v, %v; want the level still pending and nothing applied", res, err)
	}
	writeNext("")
	if res, err = aa.client.Reload(ctx); err != nil || len(res.NeedsRestart) != 0 || len(res.Applied) != 0 {
		t.Errorf("reload back to the running level = %+v, %v; want no change at all", res, err)
	}

	// A broken file changes nothing.
	if err := os.WriteFile(cfg.Path(), []byte("roles: {chat: {port: 0}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := aa.client.Reload(ctx); !errors.Is(err, admin.ErrInvalid) || !strings.Contains(err.Error(), "roles.chat.port") {
		t.Errorf("Reload of a bad file = %v, want ErrInvalid naming roles.chat.port", err)
	}
	if got, want := tablePolicy(aa.a).String(), "exposed=true serve_to=[b] accept_from=[d]"; got != want {
		t.Errorf("after a failed reload: %s, want %s", got, want)
	}
}

// fakeMesh is an in-memory MeshAPI.
type fakeMesh struct {
	mu      sync.Mutex
	revoked map[string]bool
	keys    []string
	calls   []string
}

func newFakeMesh(keys ...string) *fakeMesh { return &fakeMesh{revoked: map[string]bool{}, keys: keys} }

func (f *fakeMesh) Members() []mesh.PeerInfo {
	return []mesh.PeerInfo{
		{Name: "a", Scope: identity.ScopeFull, Admitted: true, Self: true, GossipAddr: "127.0.0.1:7946"},
		{Name: "b", Scope: identity.ScopeFull, Admitted: true, GossipAddr: "127.0.0.2:7946"},
		{Name: "x", Why: "revoked", GossipAddr: "127.0.0.9:7946"},
	}
}
func (f *fakeMesh) GossipAddr() string { return "127.0.0.1:7946" }
func (f *fakeMesh) ListKeys() ([]mesh.KeyStatus, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []mesh.KeyStatus
	for i, k := range f.keys {
		raw, err := identity.ParseGossipKey(k)
		if err != nil {
			panic(err)
		}
		out = append(out, mesh.KeyStatus{Key: k, Fingerprint: identity.GossipKeyFingerprint(raw), Primary: i == 0, Nodes: 3 - i})
	}
	return out, 3
}
func (f *fakeMesh) InstallKey(k string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys = append(f.keys, k)
	return nil
}
func (f *fakeMesh) UseKey(k string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := slices.Index(f.keys, k)
	if i < 0 {
		return mesh.ErrKeyNotInstalled
	}
	f.keys = append([]string{k}, slices.Delete(f.keys, i, i+1)...)
	return nil
}
func (f *fakeMesh) RemoveKey(k string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := slices.Index(f.keys, k)
	switch {
	case i < 0:
		return mesh.ErrKeyNotInstalled
	case i == 0:
		return fmt.Errorf("keyring remove: %w", mesh.ErrPrimaryKey)
	}
	f.keys = slices.Delete(f.keys, i, i+1)
	return nil
}
func (f *fakeMesh) Revoke(n string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.revoked[n] = true
	f.calls = append(f.calls, "revoke "+n)
	return nil
}
func (f *fakeMesh) Unrevoke(n string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.revoked, n)
	f.calls = append(f.calls, "unrevoke "+n)
	return nil
}
func (f *fakeMesh) Revoked() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return sortedKeys(f.revoked)
}
func (f *fakeMesh) Refusals() map[string]uint64 { return map[string]uint64{"bad_signature": 2} }

func (f *fakeMesh) JoinNow([]string) (int, error) { return 0, errors.New("fake mesh: no network") }

func (f *fakeMesh) RefusedNodes() []mesh.RefusedNode { return nil }

func (f *fakeMesh) CertificateExpiry() (time.Time, bool) { return time.Time{}, false }

func (f *fakeMesh) RotateGossipKey(context.Context, mesh.KeyPusher, string) (mesh.RotateResult, error) {
	return mesh.RotateResult{}, errors.New("fake mesh: no network")
}

func (f *fakeMesh) ReturnKeyring(_ context.Context, _ mesh.KeyPusher, subject, _ string) []mesh.ReturnResult {
	return []mesh.ReturnResult{{Node: subject, Err: errors.New("fake mesh: no network")}}
}

func (f *fakeMesh) KeyringPath() string { return "/var/lib/infermesh/keyring.json" }

func (f *fakeMesh) AcceptRevocation(*identity.Revocation, string) (bool, error) {
	return false, errors.New("fake mesh: takes no signed revocations")
}

func (f *fakeMesh) LoadRevocations([]*identity.Revocation) error { return nil }

func (f *fakeMesh) Revocation(string) (*identity.Revocation, bool) { return nil, false }

func (f *fakeMesh) SpreadRevocation(context.Context, mesh.RevocationPusher, *identity.Revocation) mesh.SpreadResult {
	return mesh.SpreadResult{}
}
func (f *fakeMesh) ReofferUnlisted(string, string) bool { return false }
func (f *fakeMesh) HeldAdverts() []mesh.HeldAdvert      { return nil }

func TestRevocationsPersistAndReachTheMesh(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	m := newFakeMesh()
	aa := startAdminAgent(t, cfg, AdminOptions{Mesh: m})
	ctx := context.Background()
	if _, err := aa.client.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "x", On: true}); err != nil {
		t.Fatal(err)
	}
	if got := m.Revoked(); !slices.Equal(got, []string{"x"}) {
		t.Fatalf("mesh revoked = %v, want [x]", got)
	}
	aa.stop()

	// A new mesh after the restart hears of the revocation at once.
	m2 := newFakeMesh()
	aa = startAdminAgent(t, cfg, AdminOptions{Mesh: m2})
	if got := m2.Revoked(); !slices.Equal(got, []string{"x"}) {
		t.Fatalf("after restart mesh revoked = %v, want [x]", got)
	}
	if _, err := aa.client.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "x", On: false}); err != nil {
		t.Fatal(err)
	}
	if got := m2.Revoked(); len(got) != 0 {
		t.Errorf("after unrevoke mesh revoked = %v, want none", got)
	}
	if ovs, _ := aa.client.Policy(ctx); len(ovs) != 0 {
		t.Errorf("unrevoke left overrides %+v", ovs)
	}

	peers, err := aa.client.Peers(ctx)
	if err != nil || len(peers) != 3 || peers[0].State != admin.PeerSelf || peers[2].State != admin.PeerNotAdmitted {
		t.Errorf("Peers() = %+v, %v", peers, err)
	}
	rt, err := aa.client.Route(ctx, "chat")
	if err != nil {
		t.Fatal(err)
	}
	why := map[string]string{}
	for _, d := range rt.Decisions {
		why[d.Node] = strings.Join(d.Reasons, "; ")
	}
	// No instance registered yet (no upstream in this config): this node
	// says so; b is allowlisted but never advertised; x is not admitted.
	for node, want := range map[string]string{
		"a": "role not served locally",
		"b": "no advertisement received",
		"x": "node not allowlisted for role; no advertisement received; node not admitted: revoked",
	} {
		if !strings.Contains(why[node], want) {
			t.Errorf("route reasons for %s = %q, want %q", node, why[node], want)
		}
	}
}

func TestNoMeshAnswersClearly(t *testing.T) {
	dir := t.TempDir()
	aa := startAdminAgent(t, adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1")), AdminOptions{})
	ctx := context.Background()
	if _, err := aa.client.Keyring(ctx); !errors.Is(err, admin.ErrNotConfigured) || !strings.Contains(err.Error(), "mesh") {
		t.Errorf("Keyring() without a mesh = %v, want ErrNotConfigured about the mesh", err)
	}
	if _, err := aa.client.Instances(ctx); !errors.Is(err, admin.ErrNotConfigured) {
		t.Errorf("Instances() without provisioning = %v, want ErrNotConfigured", err)
	}
	st, err := aa.client.Status(ctx)
	if err != nil || st.Mesh.State != "disabled" || st.Node != "a" || st.Version != Version {
		t.Errorf("Status() = %+v, %v", st, err)
	}
	peers, err := aa.client.Peers(ctx)
	if err != nil || len(peers) != 1 || peers[0].Name != "a" {
		t.Errorf("Peers() without a mesh = %+v, %v; want this node only", peers, err)
	}
}
