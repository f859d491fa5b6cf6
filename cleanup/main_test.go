package cleanup_test

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/internal/testing/testimage"
)

// runID makes this run's site names unique on the shared engine.
var runID = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)

var siteSeq atomic.Int64

// testImage is this run's demo image (internal/testing/testimage), removed at the
// end.
var testImage = fmt.Sprintf("%s-cleanup-%s", testimage.Tag, runID)

var testImg = &testimage.Lazy{Tag: testImage}

// bins are the static builds the tests run: the demo model as native
// instances' command.
var bins = &testbin.Lazy{Pkgs: []string{"./cmd/infermesh-demo"}}

func TestMain(m *testing.M) {
	code := m.Run()
	if err := testImg.Remove(); err != nil {
		fmt.Fprintln(os.Stderr, "cleanup tests: remove test image:", err)
	}
	bins.Remove()
	code = leakcheck.Check(code)
	os.Exit(code)
}

// requireEngine builds the test image once; an engine that cannot build it
// fails the test (it is never skipped outside -short).
func requireEngine(t *testing.T) { testImg.Require(t) }

// binary returns the static build of a command (bins).
func binary(t *testing.T, name string) string { return bins.Get(t)[name] }
