package node

import (
	"os"
	"testing"

	"github.com/infermesh/infermesh/internal/testing/leakcheck"
)

func runTests(m *testing.M) {
	code := m.Run()
	code = leakcheck.Check(code)
	os.Exit(code)
}
