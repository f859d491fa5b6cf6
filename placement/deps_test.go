package placement

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestPlacementImportsNothingOfOurs: placement is pure data and policy at
// the bottom of the layering (cmd -> agent -> {mesh, proxy, provision,
// cleanup} -> placement).
func TestPlacementImportsNothingOfOurs(t *testing.T) {
	depstest.Forbid(t, ".", depstest.Module)
}
