package main

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestShippedCommandsLinkNoTestPackage: what is shipped (the agent, the
// CLI, the demo model) links nothing under internal/testing, where the
// packages only tests import live.
func TestShippedCommandsLinkNoTestPackage(t *testing.T) {
	for _, cmd := range []string{"../infermeshd", ".", "../infermesh-demo"} {
		depstest.Forbid(t, cmd, depstest.Module+"internal/testing/")
	}
}
