package cleanup_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/docker/docker/api/types/image"
	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/internal/testbin"
	"github.com/infermesh/infermesh/internal/testimage"
	"github.com/infermesh/infermesh/provision"
)

// runID makes this run's site names unique on the shared engine.
var runID = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)

var siteSeq atomic.Int64

// testImage is this run's demo image (internal/testimage), removed at the
// end.
var testImage = fmt.Sprintf("%s-cleanup-%s", testimage.Tag, runID)

var (
	imageOnce  sync.Once
	imageErr   error
	imageBuilt atomic.Bool

	binOnce sync.Once
	binDir  string
	bins    map[string]string
	binErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if imageBuilt.Load() {
		if cli, err := provision.NewDockerClient(); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			_, err = cli.ImageRemove(ctx, testImage, image.RemoveOptions{PruneChildren: true})
			cancel()
			cli.Close()
			if err != nil {
				fmt.Fprintln(os.Stderr, "cleanup tests: remove test image:", err)
			}
		}
	}
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// requireEngine builds the test image once; an engine that cannot build it
// fails the test (it is never skipped outside -short).
func requireEngine(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("runs containers on the Docker engine; skipped in -short mode only")
	}
	imageOnce.Do(func() {
		root, err := filepath.Abs("..")
		if err == nil {
			err = testimage.Build(root, testImage)
		}
		if err == nil {
			imageBuilt.Store(true)
		}
		imageErr = err
	})
	if imageErr != nil {
		t.Fatalf("building the test image %s: %v", testImage, imageErr)
	}
}

// binary returns a static build of a command of this module (the demo model
// as native instances' command, the CLI as the root-owned data helper).
func binary(t *testing.T, name string) string {
	t.Helper()
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "cleanup-bin-")
		if binErr == nil {
			bins, binErr = testbin.Build(binDir, "./cmd/infermesh-demo")
		}
	})
	if binErr != nil {
		t.Fatalf("building binaries: %v", binErr)
	}
	return bins[name]
}
