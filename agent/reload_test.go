package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// TestReloadStopWithAgent: a reload that changes stop_with_agent decides
// what the agent's stop does, both ways: the stop reads the current
// config, not the one the agent started with.
func TestReloadStopWithAgent(t *testing.T) {
	b := staticBins(t)
	tests := []struct {
		name      string
		from, to  string // the instance's extra fields before and after the reload
		wantAlive bool   // the instance outlives the agent
	}{
		{name: "turned on", from: "", to: ", stop_with_agent: true", wantAlive: false},
		{name: "turned off", from: ", stop_with_agent: true", to: "", wantAlive: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			config, sock, _, port, _ := nativeAgentConfig(t, b, "reloadstop", tt.from)
			cfg, err := LoadConfig(config)
			if err != nil {
				t.Fatal(err)
			}
			aa := startAdminAgent(t, cfg, AdminOptions{})
			c := admin.NewClient(sock, admin.ClientOptions{Wait: 10 * time.Second})
			defer c.Close()
			pid := instanceWhen(t, c, "chat", func(i admin.Instance) bool { return i.State == "ready" && i.PID > 0 }).PID

			text, err := os.ReadFile(config)
			if err != nil {
				t.Fatal(err)
			}
			line := func(extra string) string { return fmt.Sprintf("port: %d%s}\n", port, extra) }
			edited := strings.Replace(string(text), line(tt.from), line(tt.to), 1)
			if edited == string(text) {
				t.Fatalf("the test did not edit the config:\n%s", text)
			}
			if err := os.WriteFile(config, []byte(edited), 0o600); err != nil {
				t.Fatal(err)
			}
			res, err := c.Reload(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(res.Applied, "|"); !strings.Contains(got, "roles.chat.instance") {
				t.Fatalf("reload applied %q, want the instance's change", got)
			}
			aa.stop()
			if alive := testproc.Alive(pid); alive != tt.wantAlive {
				t.Errorf("after the agent stopped: instance process alive = %v, want %v", alive, tt.wantAlive)
			}
		})
	}
}

// holdingUpstream is a static upstream on loopback: the demo model, except
// that a chat request whose body says "hold" gets its response head and a
// first event at once and the rest only when release is called.
type holdingUpstream struct {
	base    string
	release func()
}

func startHoldingUpstream(t *testing.T) *holdingUpstream {
	t.Helper()
	demo, err := demomodel.New(demomodel.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), "hold") {
			r.Body = io.NopCloser(strings.NewReader(string(body)))
			demo.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-released:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	u := &holdingUpstream{base: srv.URL, release: func() { once.Do(func() { close(released) }) }}
	t.Cleanup(func() { u.release(); srv.Close() })
	return u
}

// chatAt posts a chat request for role to the role port at addr, and
// returns the status and body (status 0 when it could not connect).
func chatAt(addr, role string) (int, string) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Post("http://"+addr+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"`+role+`","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitServes waits until role answers 200 on its port at addr, as the
// role's own model.
func waitServes(t *testing.T, addr, role string) {
	t.Helper()
	var code int
	var body string
	testproc.WaitUntil(t, role+" serving on "+addr, 30*time.Second, func() bool {
		code, body = chatAt(addr, role)
		return code == http.StatusOK && strings.Contains(body, `"model":"`+role+`"`)
	})
}

// waitClosed waits until nothing listens on addr any more.
func waitClosed(t *testing.T, addr string) {
	t.Helper()
	testproc.WaitUntil(t, addr+" closed", 30*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return false
		}
		return true
	})
}

// rolesConfig writes node a's config file in dir, with roles (lines under
// `roles:`), and returns its path.
func rolesConfig(t *testing.T, dir, roles string) string {
	t.Helper()
	path := filepath.Join(dir, "infermesh.yaml")
	text := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nproxy: {health_interval: 20ms}\nroles:\n%s",
		filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock"), roles)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func loopback(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// TestReloadAddsMovesAndRemovesRoles: one reload moves a role to a new
// port, adds a role on the port the moved one gave up, and removes a
// third, on a real agent. What must hold: the moved role serves on its new
// port; the added one serves through the proxy on its port; the removed
// role's port closes at once, while the request in flight on it finishes
// whole; then the removed role is forgotten (no local instance, no port).
func TestReloadAddsMovesAndRemovesRoles(t *testing.T) {
	up := startHoldingUpstream(t)
	dir := t.TempDir()
	ports := make([]int, 3)
	for i := range ports {
		ports[i] = testnet.TCPPort(t, "127.0.0.1")
	}
	role := func(name string, port int) string {
		return fmt.Sprintf("  %s: {port: %d, upstream: %q, model: demo}\n", name, port, up.base)
	}
	path := rolesConfig(t, dir, role("chat", ports[0])+role("embed", ports[1]))
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	aa := startAdminAgent(t, cfg, AdminOptions{})
	waitServes(t, loopback(ports[0]), "chat")
	waitServes(t, loopback(ports[1]), "embed")

	// A streamed answer on embed, under way when embed is removed.
	type result struct {
		body string
		err  error
	}
	held := make(chan result, 1)
	resp, err := http.Post("http://"+loopback(ports[1])+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"embed","stream":true,"messages":[{"role":"user","content":"hold"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	first := make([]byte, 1)
	if _, err := io.ReadFull(resp.Body, first); err != nil {
		t.Fatalf("the held answer's first byte: %v", err)
	}
	go func() {
		defer resp.Body.Close()
		rest, err := io.ReadAll(resp.Body)
		held <- result{string(first) + string(rest), err}
	}()

	// ask sorts before chat: it is added on the port chat leaves.
	rolesConfig(t, dir, role("ask", ports[0])+role("chat", ports[2]))
	res, err := aa.client.Reload(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wantApplied := []string{
		"roles.ask: added",
		fmt.Sprintf("roles.chat.port: %d -> %d", ports[0], ports[2]),
		"roles.embed: removed (its run-time overrides are kept, inactive)",
	}
	if !slices.Equal(res.Applied, wantApplied) || len(res.NeedsRestart) != 0 {
		t.Errorf("reload = applied %q, needs restart %q; want applied %q and nothing waiting", res.Applied, res.NeedsRestart, wantApplied)
	}
	waitServes(t, loopback(ports[2]), "chat")
	waitServes(t, loopback(ports[0]), "ask")
	waitClosed(t, loopback(ports[1]))
	select {
	case r := <-held:
		t.Fatalf("the answer in flight on the removed role ended before its upstream did: %q, %v", r.body, r.err)
	default:
	}
	up.release()
	if r := <-held; r.err != nil || !strings.Contains(r.body, "first") || !strings.HasSuffix(r.body, "data: [DONE]\n\n") {
		t.Errorf("the answer in flight on the removed role = %q, %v; want it whole", r.body, r.err)
	}
	waitFor(t, "the removed role to be forgotten", func() bool {
		_, port := aa.a.Table().ProxyPort("embed")
		return len(aa.a.Table().Resolve("embed")) == 0 && !port
	})
	for role, port := range map[string]int{"ask": ports[0], "chat": ports[2]} {
		if addr, ok := aa.a.RoleAddr(role); !ok || addr.String() != loopback(port) {
			t.Errorf("RoleAddr(%s) = %v, %v; want %s", role, addr, ok, loopback(port))
		}
		if p, ok := aa.a.Table().ProxyPort(role); !ok || int(p) != port {
			t.Errorf("ProxyPort(%s) = %d, %v; want %d", role, p, ok, port)
		}
	}
	if _, ok := aa.a.RoleAddr("embed"); ok {
		t.Error("RoleAddr(embed) is still set")
	}
}

// TestReloadPortInUse: a reload that adds a role on a port in use, or
// moves one there, fails for those roles and leaves them as they were
// (the moved role serves on its old port; the added one is not in the
// current config), applies the rest, and the next reload, once the ports
// are free, applies them.
func TestReloadPortInUse(t *testing.T) {
	up := startHoldingUpstream(t)
	dir := t.TempDir()
	port, taken1, taken2 := testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1")
	path := rolesConfig(t, dir, fmt.Sprintf("  chat: {port: %d, upstream: %q, model: demo}\n", port, up.base))
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	aa := startAdminAgent(t, cfg, AdminOptions{})
	waitServes(t, loopback(port), "chat")

	var holds []net.Listener
	for _, p := range []int{taken1, taken2} {
		ln, err := net.Listen("tcp", loopback(p))
		if err != nil {
			t.Fatal(err)
		}
		holds = append(holds, ln)
	}
	rolesConfig(t, dir, fmt.Sprintf("  chat: {port: %d, upstream: %q, model: demo, expose: true}\n  busy: {port: %d, upstream: %q, model: demo}\n",
		taken1, up.base, taken2, up.base))
	res, err := aa.client.Reload(context.Background())
	t.Logf("reload onto ports in use: %v", err)
	if !errors.Is(err, admin.ErrConflict) || !strings.Contains(err.Error(), "roles.chat.port") || !strings.Contains(err.Error(), "roles.busy.port") ||
		!strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("reload onto ports in use = %+v, %v; want a conflict naming roles.chat.port and roles.busy.port", res, err)
	}
	waitServes(t, loopback(port), "chat")
	if _, ok := aa.a.config().Roles["busy"]; ok {
		t.Error("the role that could not listen is in the current config")
	}
	if p := aa.a.config().Roles["chat"].Port; p != port {
		t.Errorf("the current config's chat port = %d, want %d (it still listens there)", p, port)
	}
	if got := tablePolicy(aa.a).String(); !strings.HasPrefix(got, "exposed=true") {
		t.Errorf("after the failed reload: %s; want the policy change in force", got)
	}

	for _, ln := range holds {
		ln.Close()
	}
	res, err = aa.client.Reload(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"roles.busy: added", fmt.Sprintf("roles.chat.port: %d -> %d", port, taken1)}
	if !slices.Equal(res.Applied, want) {
		t.Errorf("reload once the ports are free: applied %q, want %q", res.Applied, want)
	}
	waitServes(t, loopback(taken1), "chat")
	waitServes(t, loopback(taken2), "busy")
	waitClosed(t, loopback(port))
}

// TestReloadReplacesARolesUpstream: a kept role's upstream is replaced by
// a reload, step by step (a static upstream, a simulated instance, its
// model, the static one again), each on a real agent's proxy. What must
// hold after each: every change is applied, and the role is served by the
// new upstream (the local candidate's base and model), on the same port.
func TestReloadReplacesARolesUpstream(t *testing.T) {
	up := startHoldingUpstream(t)
	dir := t.TempDir()
	port := testnet.TCPPort(t, "127.0.0.1")
	static := fmt.Sprintf("  chat: {port: %d, upstream: %q, model: demo}\n", port, up.base)
	simulated := func(model string) string {
		return fmt.Sprintf("  chat: {port: %d, model: %s, instance: {runtime: simulated}}\n", port, model)
	}
	cfg, err := LoadConfig(rolesConfig(t, dir, static))
	if err != nil {
		t.Fatal(err)
	}
	aa := startAdminAgentWith(t, cfg, Options{Simulated: demoDevModel}, AdminOptions{})
	waitServes(t, loopback(port), "chat")
	steps := []struct {
		name    string
		roles   string
		applied []string
		model   string
		static  bool // served by up
	}{
		{
			name: "a simulated instance for the static upstream", roles: simulated("tiny"),
			applied: []string{fmt.Sprintf("roles.chat.upstream: %q -> \"\"", up.base), `roles.chat.model: "demo" -> "tiny"`, "roles.chat.instance: added"},
			model:   "tiny",
		},
		{name: "its model", roles: simulated("tiny2"), applied: []string{`roles.chat.model: "tiny" -> "tiny2"`}, model: "tiny2"},
		{
			name: "the static upstream again", roles: static,
			applied: []string{fmt.Sprintf("roles.chat.upstream: \"\" -> %q", up.base), `roles.chat.model: "tiny2" -> "demo"`, "roles.chat.instance: removed"},
			model:   "demo", static: true,
		},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			rolesConfig(t, dir, st.roles)
			res, err := aa.client.Reload(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(res.Applied, st.applied) || len(res.NeedsRestart) != 0 {
				t.Errorf("reload = applied %q, needs restart %q; want applied %q", res.Applied, res.NeedsRestart, st.applied)
			}
			waitFor(t, "the new upstream registered", func() bool {
				c := aa.a.Table().Resolve("chat")
				return len(c) == 1 && c[0].Model == st.model && (c[0].Base == up.base) == st.static
			})
			waitServes(t, loopback(port), "chat")
		})
	}
}

// TestReloadRemovesAManagedRole: a reload that removes a role with a
// managed (native) instance closes the role's port and then has the
// instance manager remove the instance: its process ends, and the agent
// lists no instance for the role any more.
func TestReloadRemovesAManagedRole(t *testing.T) {
	b := staticBins(t)
	config, sock, _, _, rolePort := nativeAgentConfig(t, b, "reloadrm", "")
	cfg, err := LoadConfig(config)
	if err != nil {
		t.Fatal(err)
	}
	startAdminAgent(t, cfg, AdminOptions{})
	c := admin.NewClient(sock, admin.ClientOptions{Wait: 10 * time.Second})
	defer c.Close()
	pid := instanceWhen(t, c, "chat", func(i admin.Instance) bool { return i.State == "ready" && i.PID > 0 }).PID

	text, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	head, _, ok := strings.Cut(string(text), "roles:\n")
	if !ok {
		t.Fatalf("no roles in the config:\n%s", text)
	}
	if err := os.WriteFile(config, []byte(head+"roles: {}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	res, err := c.Reload(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"roles.chat: removed (its run-time overrides are kept, inactive)"}; !slices.Equal(res.Applied, want) || len(res.NeedsRestart) != 0 {
		t.Errorf("reload = applied %q, needs restart %q; want %q", res.Applied, res.NeedsRestart, want)
	}
	waitClosed(t, loopback(rolePort))
	testproc.WaitUntil(t, "the removed role's instance process to end", 60*time.Second, func() bool { return !testproc.Alive(pid) })
	testproc.WaitUntil(t, "the instance gone from the list", 60*time.Second, func() bool {
		is, err := c.Instances(context.Background())
		return err == nil && !slices.ContainsFunc(is, func(i admin.Instance) bool { return i.Role == "chat" })
	})
}

// TestReloadWaitsForAnInstanceManager: an agent that started without a
// managed instance runs no instance manager, so a reload that adds one
// (a new role, or a role switched from its static upstream) says it
// needs a restart and why, and the role's other serving changes wait with
// it: the role keeps serving as it was, and the added one is not served.
func TestReloadWaitsForAnInstanceManager(t *testing.T) {
	up := startHoldingUpstream(t)
	dir := t.TempDir()
	port, gpu := testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1")
	cfg, err := LoadConfig(rolesConfig(t, dir, fmt.Sprintf("  chat: {port: %d, upstream: %q, model: demo}\n", port, up.base)))
	if err != nil {
		t.Fatal(err)
	}
	aa := startAdminAgent(t, cfg, AdminOptions{})
	waitServes(t, loopback(port), "chat")
	native := "{runtime: native, command: /bin/true, port: 9}"
	rolesConfig(t, dir, fmt.Sprintf("  chat: {port: %d, model: demo, expose: true, instance: %s}\n  gpu: {port: %d, instance: %s}\n", port, native, gpu, native))
	res, err := aa.client.Reload(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wantRestart := []string{
		fmt.Sprintf("roles.chat.upstream: %q -> \"\" (%s)", up.base, noManager),
		"roles.chat.instance: added (" + noManager + ")",
		"roles.gpu: added (" + noManager + ")",
	}
	if !slices.Equal(res.NeedsRestart, wantRestart) {
		t.Errorf("needs restart = %q\nwant %q", res.NeedsRestart, wantRestart)
	}
	if want := []string{"roles.chat.expose: false -> true"}; !slices.Equal(res.Applied, want) {
		t.Errorf("applied = %q, want %q", res.Applied, want)
	}
	cur := aa.a.config()
	if _, ok := cur.Roles["gpu"]; ok || cur.Roles["chat"].Upstream != up.base || cur.Roles["chat"].Instance != nil {
		t.Errorf("current config: roles %v, chat %+v; want chat as it was and no gpu", sortedKeys(cur.Roles), cur.Roles["chat"])
	}
	waitServes(t, loopback(port), "chat")
	if _, ok := aa.a.RoleAddr("gpu"); ok {
		t.Error("the role that waits for a restart listens")
	}
}
