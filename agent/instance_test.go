package agent

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/infermesh/infermesh/internal/testing/testimage"
	"github.com/infermesh/infermesh/provision"
)

// TestManagedInstanceEndToEnd runs a role served by a real Docker container:
// the agent creates it, serves a chat completion through the loopback proxy,
// and after an agent restart adopts the same container without restarting
// it. Removing the role from the config then removes the container.
func TestManagedInstanceEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("uses the Docker engine; skipped in -short mode only")
	}
	const image = "infermesh-demo:agent-test" // provision's tests build testimage.Tag in parallel
	cli, site := dockerSite(t, "agent-e2e", image)
	siteFilter := filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+site))

	dir := t.TempDir()
	cfgText := func(withRole bool) string {
		s := "node: {name: n1, state_dir: " + dir + "}\nsite: " + site + "\nadmin: {socket: " + dir + "/admin.sock}\nroles:\n"
		s += "  other: {port: 1, upstream: 'http://127.0.0.1:9'}\n"
		if withRole {
			s += "  chat:\n    port: 2\n    model: demo\n    instance: {image: '" + image + "', port: 8080, restart: {max: 2, backoff: 100ms}}\n"
		}
		return s
	}
	load := func(withRole bool) *Config {
		cfg, err := ParseConfig([]byte(cfgText(withRole)))
		if err != nil {
			t.Fatal(err)
		}
		for name, r := range cfg.Roles {
			r.Port = 0
			cfg.Roles[name] = r
		}
		return cfg
	}
	fast := Options{ProvisionTuning: func(c *provision.ManagerConfig) {
		c.ProbeInterval = 50 * time.Millisecond
		c.ReadyTimeout = 30 * time.Second
	}}

	start := func(cfg *Config) (*Agent, func()) {
		a, err := New(cfg, fast)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- a.Run(ctx) }()
		return a, func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		}
	}
	containerOf := func() container.Summary {
		t.Helper()
		list, err := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: siteFilter})
		if err != nil {
			t.Fatal(err)
		}
		if len(list) != 1 {
			for _, c := range list {
				t.Logf("container %s %v %s", c.ID, c.Names, c.State)
			}
			t.Fatalf("containers of site %s = %d, want exactly 1", site, len(list))
		}
		return list[0]
	}
	chat := func(a *Agent) {
		t.Helper()
		waitFor(t, "the instance to serve", func() bool { return len(a.Table().Resolve("chat")) == 1 })
		addr, _ := a.RoleAddr("chat")
		c := openai.NewClient(option.WithBaseURL("http://"+addr.String()+"/v1"), option.WithMaxRetries(0))
		resp, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model:    "chat",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
		})
		if err != nil {
			for _, e := range a.Audit().Recent() {
				t.Logf("audit: %s %s %v", e.Kind, e.Role, e.Fields)
			}
			t.Fatalf("chat through the proxy: %v", err)
		}
		if resp.Model != "chat" || resp.Choices[0].Message.Content == "" {
			t.Errorf("response = %+v", resp)
		}
	}

	a, stop := start(load(true))
	chat(a)
	// The instance's state and restarts are in the metrics.
	rec := httptest.NewRecorder()
	a.metrics.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{`infermesh_instance_state{role="chat",state="ready"} 1`, `infermesh_instance_restarts_total{role="chat"} 0`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	first := containerOf()
	inspect1, err := cli.ContainerInspect(context.Background(), first.ID)
	if err != nil {
		t.Fatal(err)
	}
	stop()

	a, stop = start(load(true))
	chat(a)
	again := containerOf()
	inspect2, _ := cli.ContainerInspect(context.Background(), again.ID)
	if again.ID != first.ID {
		t.Errorf("after restart the container is %s, want the adopted %s", again.ID, first.ID)
	}
	if inspect2.State.StartedAt != inspect1.State.StartedAt {
		t.Errorf("adopted container was restarted: started %s, then %s", inspect1.State.StartedAt, inspect2.State.StartedAt)
	}
	stop()

	// The role is gone from the config: the next start removes its
	// container (its intent is remembered in the state store).
	a, stop = start(load(false))
	defer stop()
	waitFor(t, "the container of the removed role to go", func() bool {
		list, err := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: siteFilter})
		return err == nil && len(list) == 0
	})
	_ = a
}

// dockerSite builds image (the demo model's test image) and returns a
// Docker client and a new site name whose containers are removed when the
// test ends.
func dockerSite(t *testing.T, prefix, image string) (*client.Client, string) {
	t.Helper()
	root, _ := filepath.Abs("..")
	if err := testimage.Build(root, image); err != nil {
		t.Fatalf("building the test image: %v", err)
	}
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	site := fmt.Sprintf("%s-%x", prefix, time.Now().UnixNano()&0xffffff)
	siteFilter := filters.NewArgs(filters.Arg("label", provision.LabelSite+"="+site))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		list, _ := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: siteFilter})
		for _, c := range list {
			_ = cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true})
		}
		_ = cli.Close()
	})
	return cli, site
}

// TestManagedInstanceProbedWithUpstreamKey: a managed container whose
// server requires its API key on every path, the health path included (the
// demo model with -api-key, as LiteLLM's master key does), is probed with
// roles.<r>.upstream_api_key_file's key, so it becomes ready and serves.
func TestManagedInstanceProbedWithUpstreamKey(t *testing.T) {
	if testing.Short() {
		t.Skip("uses the Docker engine; skipped in -short mode only")
	}
	const image = "infermesh-demo:agent-test"
	_, site := dockerSite(t, "agent-key", image)
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "chat.key")
	if err := os.WriteFile(keyFile, []byte("sk-container\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := ParseConfig([]byte("node: {name: n1, state_dir: " + dir + "}\nsite: " + site + "\nadmin: {socket: " + dir + "/admin.sock}\nroles:\n" +
		"  chat:\n    port: 1\n    model: demo\n    upstream_api_key_file: " + keyFile + "\n" +
		"    instance: {image: '" + image + "', port: 8080, env: {INFERMESH_DEMO_API_KEY: sk-container}, restart: {max: 2, backoff: 100ms}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Roles["chat"]
	r.Port = 0
	cfg.Roles["chat"] = r
	a := runAgent(t, cfg, Options{ProvisionTuning: func(c *provision.ManagerConfig) {
		c.ProbeInterval = 50 * time.Millisecond
		c.ReadyTimeout = 30 * time.Second
	}})
	waitFor(t, "the key-protected container to be probed ready", func() bool { return len(a.Table().Resolve("chat")) == 1 })
	addr, _ := a.RoleAddr("chat")
	if st := chatStatus(t, "http://"+addr.String()); st != http.StatusOK {
		t.Errorf("chat through the proxy: status %d, want 200", st)
	}
	// The container refuses requests without the key: the probe passed
	// because it carried the key.
	ep := ""
	for _, c := range a.Table().Resolve("chat") {
		ep = c.Base
	}
	resp, err := http.Get(ep + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET %s/health without the key: %d, want 401", ep, resp.StatusCode)
	}
}
