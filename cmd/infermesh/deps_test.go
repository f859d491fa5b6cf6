package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCLIDoesNotLinkTheMesh: the CLI talks to the agent over its admin
// socket and makes keys offline; it links neither the QUIC stack nor
// memberlist (node identity lives in package identity for that reason).
func TestCLIDoesNotLinkTheMesh(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/quic-go/", "github.com/hashicorp/memberlist", "github.com/infermesh/infermesh/mesh"} {
			if strings.HasPrefix(dep, banned) {
				t.Errorf("the CLI links %s", dep)
			}
		}
	}
}
