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
