package agent

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/internal/testproc"
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
