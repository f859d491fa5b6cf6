// Package testbin builds this module's commands as static binaries
// (CGO_ENABLED=0, as `make build` does) for tests that run them somewhere
// else: inside a node container, or as a separate process to kill. The Go
// build cache makes every build after the first a link step.
package testbin

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// ModuleRoot returns the directory of this module's go.mod.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", fmt.Errorf("not inside a module")
	}
	return filepath.Dir(mod), nil
}

// Build builds each package (module-relative, e.g. "./cmd/infermeshd")
// statically into dir and returns the binaries' paths by the package's
// last path element.
func Build(dir string, pkgs ...string) (map[string]string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, len(pkgs))
	for _, pkg := range pkgs {
		name := filepath.Base(pkg)
		bin := filepath.Join(dir, name)
		cmd := exec.Command("go", "build", "-trimpath", "-o", bin, pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
		}
		out[name] = bin
	}
	return out, nil
}

// Lazy is a test binary's static builds of some commands: built on first
// use (Get), once, into a directory every user may read (a test may run
// them as another user); Remove deletes them.
type Lazy struct {
	// Pkgs are the module-relative packages, e.g. "./cmd/infermesh-demo".
	Pkgs []string

	once sync.Once
	dir  string
	bins map[string]string
	err  error
}

// Get builds the commands once and returns their paths by name (the
// package's last path element), failing the test when they do not build.
func (l *Lazy) Get(t testing.TB) map[string]string {
	t.Helper()
	l.once.Do(func() {
		if l.dir, l.err = os.MkdirTemp("", "infermesh-bin-"); l.err != nil {
			return
		}
		if l.err = os.Chmod(l.dir, 0o755); l.err == nil {
			l.bins, l.err = Build(l.dir, l.Pkgs...)
		}
	})
	if l.err != nil {
		t.Fatalf("building %v: %v", l.Pkgs, l.err)
	}
	return l.bins
}

// Remove deletes the builds, if any.
func (l *Lazy) Remove() {
	if l.dir != "" {
		os.RemoveAll(l.dir)
	}
}
