package agent

import (
	"context"
	"fmt"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/infermesh/infermesh/internal/testimage"
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
	root, _ := filepath.Abs("..")
	const image = "infermesh-demo:agent-test" // provision's tests build testimage.Tag in parallel
	if err := testimage.Build(root, image); err != nil {
		t.Fatalf("building the test image: %v", err)
	}
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	site := fmt.Sprintf("agent-e2e-%x", time.Now().UnixNano()&0xffffff)
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
