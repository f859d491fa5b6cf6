package node

import (
	"os"
	"testing"

	"github.com/infermesh/infermesh/internal/leakcheck"
)

func runTests(m *testing.M) {
	code := m.Run()
	code = leakcheck.Check(code)
	os.Exit(code)
}
