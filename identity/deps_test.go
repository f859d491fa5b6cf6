package identity

import (
	"testing"

	"github.com/infermesh/infermesh/internal/testing/depstest"
)

// TestIdentityIsALeaf: identity imports nothing of ours and no network
// library, so anything (the CLI included) can use it cheaply.
func TestIdentityIsALeaf(t *testing.T) {
	depstest.Forbid(t, ".", depstest.Module, "github.com/quic-go/", "github.com/hashicorp/", "net/http")
}
