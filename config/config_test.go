package config_test

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestConfigIsALeaf: everything that reads or writes a config may import
// package config, so it imports nothing of infermesh's.
func TestConfigIsALeaf(t *testing.T) {
	depstest.Forbid(t, ".", depstest.Module)
}
