package main

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestCLIDoesNotLinkTheMesh: the CLI talks to the agent over its admin
// socket and makes keys offline; it links neither the QUIC stack nor
// memberlist (node identity lives in package identity for that reason).
func TestCLIDoesNotLinkTheMesh(t *testing.T) {
	depstest.Forbid(t, ".", "github.com/quic-go/", "github.com/hashicorp/memberlist", depstest.Module+"mesh")
}
