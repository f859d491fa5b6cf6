// Package nodeimage builds and runs the infermesh node image: a Debian
// bookworm root filesystem with systemd as PID 1 and a real OpenSSH sshd,
// imported into the local Docker engine (there is no registry). A container
// of it is a real systemd host reached over SSH, so bootstrapping a docker
// node exercises exactly what bootstrapping a server does: an SSH session,
// file uploads, systemctl.
//
// # The recipe
//
//	debootstrap --variant=minbase \
//	    --include=systemd,systemd-sysv,openssh-server,dbus,iproute2 bookworm <dir> <mirror>
//
// then a few edits of <dir> (the edits variable): the SSH host keys
// debootstrap generated are deleted, so no two containers share one and each
// container gets the key its creator pins (see SeedFiles); password logins
// are off; /etc/machine-id is emptied, so systemd makes one per container;
// the apt and fstrim timers are disabled, so a node does no surprise work.
// Finally
//
//	tar -C <dir> -c . | docker import -c 'CMD ["/sbin/init"]' - infermesh-node:<hash>
//
// The tag's hash covers every input of the recipe (suite, variant,
// packages, mirror, edits, image changes), so a changed recipe gets a new
// tag and an unchanged one is built once per engine and reused by every
// later run, every package's tests and CI. Concurrent builders of one tag
// serialize on a lock file in the cache directory; the second finds the
// image built and returns.
//
// # Running a node container
//
// The image runs unprivileged (this engine refuses --privileged):
//
//	docker run -d --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro <tag>
//
// ContainerConfig returns exactly that configuration. sshd refuses to start
// until the container holds a host key: write it with SeedFiles between
// create and start, and the key is pinned from the first byte. WaitReady
// waits until `systemctl is-system-running` says running (or degraded,
// returning which units failed) and ssh.service is active. The unit
// configs/infermeshd.service runs there unchanged (Type=notify, its status
// line shows) once its user exists: configs/infermesh.sysusers in
// /etc/sysusers.d, then systemd-sysusers, as make install and the node
// bootstrap do. The image has no docker group.
//
// # From tests
//
//	tag, err := nodeimage.Ensure(ctx, cli, nodeimage.Options{})   // once, in TestMain
//	id, err := nodeimage.Boot(ctx, cli, nodeimage.BootOptions{Tag: tag, Name: ..., Labels: ..., HostKey: signer, AuthorizedKeys: ...})
//	err = nodeimage.WaitReady(ctx, cli, id)
//	out, code, err := nodeimage.Exec(ctx, cli, id, "systemctl", "is-active", "ssh")
//
// Name and label containers uniquely and remove them in t.Cleanup. Building
// needs root, debootstrap (apt-get install debootstrap) and a Debian mirror;
// it takes about a minute, once.
package nodeimage

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"
	"golang.org/x/sys/unix"
)

// The recipe's inputs. Changing any of them changes Tag.
const (
	Suite         = "bookworm"
	Variant       = "minbase"
	DefaultMirror = "http://deb.debian.org/debian"
	// Repository is the image name; the tag is the recipe hash.
	Repository = "infermesh-node"
	// LabelRecipe is the image label holding the full recipe hash.
	LabelRecipe = "io.infermesh.node-image.recipe"
)

// Packages are the packages debootstrap includes besides the minimal base.
var Packages = []string{"systemd", "systemd-sysv", "openssh-server", "dbus", "iproute2"}

// edit is one change to the bootstrapped root filesystem. They are data,
// not code, so that the recipe hash covers them.
type edit struct {
	Op   string      `json:"op"` // "remove" (a glob) or "write"
	Path string      `json:"path"`
	Data string      `json:"data,omitempty"`
	Mode fs.FileMode `json:"mode,omitempty"`
}

// sshdConfig is the node's sshd policy: keys only, and only the ed25519
// host key its creator pins.
const sshdConfig = `# infermesh node image: key authentication only; the host key is written
# by whoever creates the container, before it starts.
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
HostKey /etc/ssh/ssh_host_ed25519_key
`

var edits = []edit{
	{Op: "remove", Path: "/etc/ssh/ssh_host_*"},
	{Op: "write", Path: "/etc/ssh/sshd_config.d/infermesh-node.conf", Data: sshdConfig, Mode: 0o644},
	{Op: "write", Path: "/etc/machine-id", Data: "", Mode: 0o444},
	{Op: "remove", Path: "/var/lib/dbus/machine-id"},
	{Op: "remove", Path: "/etc/systemd/system/timers.target.wants/*"},
	{Op: "remove", Path: "/var/cache/apt/archives/*.deb"},
	{Op: "remove", Path: "/var/lib/apt/lists/*_Packages"},
}

// changes are applied by docker import.
var changes = []string{`CMD ["/sbin/init"]`}

// Options configure Ensure. Zero values mean the defaults.
type Options struct {
	// Mirror is the Debian mirror debootstrap fetches from. Default
	// DefaultMirror.
	Mirror string
	// CacheDir holds the lock files and the build's staging directory.
	// Default <user cache dir>/infermesh/nodeimage.
	CacheDir string
	// Log receives progress lines. Nil: none.
	Log func(string)
}

func (o *Options) fill() error {
	if o.Mirror == "" {
		o.Mirror = DefaultMirror
	}
	if o.CacheDir == "" {
		dir, err := os.UserCacheDir()
		if err != nil {
			dir = os.TempDir()
		}
		o.CacheDir = filepath.Join(dir, "infermesh", "nodeimage")
	}
	if o.Log == nil {
		o.Log = func(string) {}
	}
	return os.MkdirAll(o.CacheDir, 0o755)
}

// RecipeHash is the hex sha256 of every recipe input with this mirror.
func RecipeHash(mirror string) string {
	if mirror == "" {
		mirror = DefaultMirror
	}
	b, err := json.Marshal(struct {
		Suite    string   `json:"suite"`
		Variant  string   `json:"variant"`
		Packages []string `json:"packages"`
		Mirror   string   `json:"mirror"`
		Edits    []edit   `json:"edits"`
		Changes  []string `json:"changes"`
	}{Suite, Variant, Packages, mirror, edits, changes})
	if err != nil {
		panic(fmt.Sprintf("nodeimage: recipe: %v", err)) // strings only: cannot fail
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Tag is the image reference of the recipe with the default mirror.
func Tag() string { return TagFor(DefaultMirror) }

// TagFor is the image reference of the recipe with mirror.
func TagFor(mirror string) string { return Repository + ":" + RecipeHash(mirror)[:16] }

// ImageAPI is the part of the Docker client Ensure uses; *client.Client
// satisfies it.
type ImageAPI interface {
	ImageInspect(ctx context.Context, image string, opts ...client.ImageInspectOption) (image.InspectResponse, error)
	ImageImport(ctx context.Context, source image.ImportSource, ref string, options image.ImportOptions) (io.ReadCloser, error)
}

// ErrNoDebootstrap is returned when the image must be built and debootstrap
// is not installed.
var ErrNoDebootstrap = errors.New("debootstrap not found (apt-get install debootstrap)")

// Ensure returns the tag of the node image, building it first when the
// engine does not have it.
func Ensure(ctx context.Context, api ImageAPI, opts Options) (string, error) {
	if err := opts.fill(); err != nil {
		return "", fmt.Errorf("node image: cache dir: %w", err)
	}
	tag := TagFor(opts.Mirror)
	if ok, err := present(ctx, api, tag); err != nil || ok {
		return tag, err
	}
	unlock, err := lock(ctx, filepath.Join(opts.CacheDir, strings.ReplaceAll(tag, ":", "_")+".lock"))
	if err != nil {
		return "", fmt.Errorf("node image %s: %w", tag, err)
	}
	defer unlock()
	// Another builder may have finished while we waited.
	if ok, err := present(ctx, api, tag); err != nil || ok {
		return tag, err
	}
	if err := build(ctx, api, tag, opts); err != nil {
		return "", fmt.Errorf("node image %s: %w", tag, err)
	}
	return tag, nil
}

func present(ctx context.Context, api ImageAPI, tag string) (bool, error) {
	_, err := api.ImageInspect(ctx, tag)
	switch {
	case err == nil:
		return true, nil
	case cerrdefs.IsNotFound(err):
		return false, nil
	default:
		return false, fmt.Errorf("node image %s: %w", tag, err)
	}
}

// lock takes an exclusive flock on path, polling so that ctx is honoured.
func lock(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() {
				_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
				f.Close()
			}, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for another build (lock %s): %w", path, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func build(ctx context.Context, api ImageAPI, tag string, opts Options) error {
	deboot, err := exec.LookPath("debootstrap")
	if err != nil {
		if deboot, err = exec.LookPath("/usr/sbin/debootstrap"); err != nil {
			return ErrNoDebootstrap
		}
	}
	dir, err := os.MkdirTemp(opts.CacheDir, "rootfs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	opts.Log(fmt.Sprintf("debootstrap %s into %s (about a minute)", Suite, dir))
	args := []string{"--variant=" + Variant, "--include=" + strings.Join(Packages, ","), Suite, dir, opts.Mirror}
	if err := run(ctx, opts.Log, deboot, args...); err != nil {
		return fmt.Errorf("debootstrap: %w", err)
	}
	if err := applyEdits(dir); err != nil {
		return err
	}

	opts.Log("docker import " + tag)
	tarCmd := exec.CommandContext(ctx, "tar", "--numeric-owner", "-C", dir, "-c", ".")
	stdout, err := tarCmd.StdoutPipe()
	if err != nil {
		return err
	}
	var tarErr strings.Builder
	tarCmd.Stderr = &tarErr
	if err := tarCmd.Start(); err != nil {
		return fmt.Errorf("tar: %w", err)
	}
	imgChanges := append(append([]string(nil), changes...), "LABEL "+LabelRecipe+"="+RecipeHash(opts.Mirror))
	rc, err := api.ImageImport(ctx, image.ImportSource{Source: stdout, SourceName: "-"}, tag,
		image.ImportOptions{Changes: imgChanges, Message: "infermesh node image (" + Suite + ", " + Variant + ")"})
	if err != nil {
		_ = tarCmd.Process.Kill()
		_ = tarCmd.Wait()
		return fmt.Errorf("docker import: %w", err)
	}
	_, copyErr := io.Copy(io.Discard, rc)
	rc.Close()
	if err := tarCmd.Wait(); err != nil {
		return fmt.Errorf("tar: %w: %s", err, tarErr.String())
	}
	if copyErr != nil {
		return fmt.Errorf("docker import: %w", copyErr)
	}
	if ok, err := present(ctx, api, tag); err != nil || !ok {
		return fmt.Errorf("docker import finished but %s is not there (%v)", tag, err)
	}
	opts.Log("built " + tag)
	return nil
}

// run runs a command, passing its output lines to log.
func run(ctx context.Context, log func(string), name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	done := make(chan struct{})
	var tail []string
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			log(sc.Text())
			tail = append(tail, sc.Text())
			if len(tail) > 20 {
				tail = tail[1:]
			}
		}
	}()
	err := cmd.Run()
	pw.Close()
	<-done
	if err != nil {
		return fmt.Errorf("%w\n%s", err, strings.Join(tail, "\n"))
	}
	return nil
}

func applyEdits(root string) error {
	for _, e := range edits {
		p := filepath.Join(root, e.Path)
		switch e.Op {
		case "remove":
			matches, err := filepath.Glob(p)
			if err != nil {
				return fmt.Errorf("edit %s: %w", e.Path, err)
			}
			for _, m := range matches {
				if err := os.RemoveAll(m); err != nil {
					return fmt.Errorf("edit %s: %w", e.Path, err)
				}
			}
		case "write":
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return fmt.Errorf("edit %s: %w", e.Path, err)
			}
			_ = os.Remove(p)
			if err := os.WriteFile(p, []byte(e.Data), e.Mode); err != nil {
				return fmt.Errorf("edit %s: %w", e.Path, err)
			}
			if err := os.Chmod(p, e.Mode); err != nil {
				return fmt.Errorf("edit %s: %w", e.Path, err)
			}
		default:
			return fmt.Errorf("edit %s: unknown op %q", e.Path, e.Op)
		}
	}
	return nil
}
