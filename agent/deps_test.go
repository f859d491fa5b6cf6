package agent

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestAgentDoesNotLinkTheDemoModel: the production daemon carries no demo
// model; dev mode gets it from cmd/infermeshd through Options.DevModel.
func TestAgentDoesNotLinkTheDemoModel(t *testing.T) {
	depstest.Forbid(t, ".", depstest.Module+"demomodel")
}
