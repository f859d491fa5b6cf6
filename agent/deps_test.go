package agent

import (
	"os/exec"
	"strings"
	"testing"
)

// TestAgentDoesNotLinkTheDemoModel: the production daemon carries no demo
// model; dev mode gets it from cmd/infermeshd through Options.DevModel.
func TestAgentDoesNotLinkTheDemoModel(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) == 0 || deps[len(deps)-1] != "github.com/infermesh/infermesh/agent" {
		t.Fatalf("go list -deps did not list the agent package last: %q", out)
	}
	for _, dep := range deps {
		if dep == "github.com/infermesh/infermesh/demomodel" {
			t.Errorf("the agent links %s", dep)
		}
	}
}
