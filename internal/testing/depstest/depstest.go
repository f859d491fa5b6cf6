// Package depstest keeps the layering honest in tests: it asserts what a
// package links (go list -deps, the package's non-test build), so that the
// CLI stays free of the mesh, the agent of the demo model, and the leaf
// packages (placement, identity) of everything of ours.
package depstest

import (
	"os/exec"
	"strings"
	"testing"
)

// Module is the import path prefix of infermesh's own packages.
const Module = "github.com/infermesh/infermesh/"

// Forbid fails t when the package in dir (a go list pattern such as ".")
// links a package whose import path starts with one of prefixes. The
// package itself is not counted.
func Forbid(t testing.TB, dir string, prefixes ...string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", dir, err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) == 0 {
		t.Fatalf("go list -deps %s listed nothing", dir)
	}
	self := deps[len(deps)-1] // go list -deps lists the package after its dependencies
	for _, dep := range deps[:len(deps)-1] {
		for _, p := range prefixes {
			if strings.HasPrefix(dep, p) {
				t.Errorf("%s links %s", self, dep)
			}
		}
	}
}
