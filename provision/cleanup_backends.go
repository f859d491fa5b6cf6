package provision

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/pkg/stdcopy"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/defaults"
)

// HelperAPI is what removing root-owned site data needs of the engine
// beyond DockerAPI: importing the helper image and removing it again.
// *DockerClient satisfies it.
type HelperAPI interface {
	DockerAPI
	ImageImport(ctx context.Context, source image.ImportSource, ref string, options image.ImportOptions) (io.ReadCloser, error)
	ImageRemove(ctx context.Context, image string, options image.RemoveOptions) ([]image.DeleteResponse, error)
}

var _ HelperAPI = (*DockerClient)(nil)

// SiteCleanupsConfig configures SiteCleanups. Zero values mean the default.
type SiteCleanupsConfig struct {
	// Docker is the engine (required; it need not be reachable: then the
	// Docker runtime is unreachable, which fails a cleanup that binds it).
	Docker HelperAPI
	// Layout is where the site keeps things on this host (required).
	Layout cleanup.Layout
	// Node is this node, the one whose helper container removes root-owned
	// data (required).
	Node string
	// CallTimeout and StopTimeout: DefaultDockerConfig's.
	CallTimeout time.Duration
	StopTimeout time.Duration
	// Helper is a static executable that, run as Helper HelperArgs... DIR,
	// removes everything inside DIR. It runs alone in a FROM scratch helper
	// container as root to remove the site data containers left owned by
	// root. The infermesh CLI passes itself. Empty: root-owned data is an
	// error.
	Helper     string
	HelperArgs []string
	// Logger; nil means zap.NewNop().
	Logger *zap.Logger
}

// SiteCleanups is the runtime-specific side of stopped-site operations
// (cleanup.Backends) for the runtimes this package knows: Docker and native.
type SiteCleanups struct {
	cfg SiteCleanupsConfig
}

var _ cleanup.Backends = (*SiteCleanups)(nil)

// NewSiteCleanups validates cfg.
func NewSiteCleanups(cfg SiteCleanupsConfig) (*SiteCleanups, error) {
	if cfg.Docker == nil {
		return nil, errors.New("site cleanups: Docker is nil")
	}
	if err := cfg.Layout.Validate(); err != nil {
		return nil, fmt.Errorf("site cleanups: %w", err)
	}
	if err := identity.ValidateNodeName(cfg.Node); err != nil {
		return nil, fmt.Errorf("site cleanups: node: %w", err)
	}
	d := DefaultDockerConfig()
	defaults.Positive(&cfg.CallTimeout, d.CallTimeout)
	defaults.Positive(&cfg.StopTimeout, d.StopTimeout)
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	return &SiteCleanups{cfg: cfg}, nil
}

// SiteCleanup implements cleanup.Backends: the Docker runtime, then the
// native runtime, each bound when its kind is. Simulated instances live
// inside the agent and leave nothing: that kind selects nothing. Both
// runtimes are always selected, because a site whose configuration no
// longer binds one may still have left resources in it: unbound, a
// runtime is optional.
func (b *SiteCleanups) SiteCleanup(bound cleanup.KindSet) (*cleanup.SiteCleanup, error) {
	for _, k := range bound.Kinds() {
		if _, err := cleanup.ParseKind(string(k)); err != nil {
			return nil, err
		}
	}
	return cleanup.NewSiteCleanup(
		cleanup.Part{Runtime: NewDockerSiteCleanup(b.cfg.Docker, b.cfg.CallTimeout, b.cfg.StopTimeout), Bound: bound.Has(cleanup.Docker)},
		cleanup.Part{Runtime: NewNativeSiteCleanup(b.cfg.Layout.SiteRoot(), b.cfg.StopTimeout), Bound: bound.Has(cleanup.Native)},
	), nil
}

// LocatedWorkloads implements cleanup.Backends: native workloads by their
// records under root (a site root, or a node folder when node is set).
func (b *SiteCleanups) LocatedWorkloads(root, site, node string) cleanup.LocatedWorkloads {
	return &nativeLocated{
		find:        nativeFinder{root: root, isNode: node != "", site: site, node: node},
		stopTimeout: b.cfg.StopTimeout,
	}
}

// RemoveWorkloadCaches implements cleanup.Backends: the site's cache
// directory under the cache root (or node's within it). Nothing else under
// the cache root is touched.
func (b *SiteCleanups) RemoveWorkloadCaches(ctx context.Context, site, node string) ([]string, error) {
	if err := identity.ValidateNodeName(site); err != nil {
		return nil, fmt.Errorf("workload caches: site: %w", err)
	}
	l := b.cfg.Layout
	l.Site = site
	dir := l.SiteCache()
	if node != "" {
		if err := identity.ValidateNodeName(node); err != nil {
			return nil, fmt.Errorf("workload caches: node: %w", err)
		}
		dir = l.NodeCache(node)
	}
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("workload cache %s: %w", dir, err)
	}
	return []string{dir}, nil
}

// ForgetIntents implements cleanup.Backends: every intent in the store.
func (b *SiteCleanups) ForgetIntents(lock *cleanup.StoreLock) (int, error) {
	intents, err := NewBoltIntents(lock.Store())
	if err != nil {
		return 0, err
	}
	all, err := intents.Intents()
	if err != nil {
		return 0, err
	}
	for ref := range all {
		if err := intents.DeleteIntent(ref); err != nil {
			return 0, err
		}
	}
	return len(all), nil
}

// RemoveRootOwnedSiteData implements cleanup.Backends. What a container
// running as root wrote into a bind mount under the site root belongs to
// root, and a host process that is not root cannot remove it; the engine
// can. A helper container (a FROM scratch image holding only the static
// Helper, imported for the occasion and removed after) runs as root with
// dir bind-mounted and removes everything inside it. The helper container
// carries the site's labels, so a cleanup finds it should it outlive this
// call.
func (b *SiteCleanups) RemoveRootOwnedSiteData(ctx context.Context, dir string) error {
	root := b.cfg.Layout.SiteRoot()
	dir = filepath.Clean(dir)
	if dir != root && !strings.HasPrefix(dir, root+string(filepath.Separator)) {
		return fmt.Errorf("root-owned site data: %s is not under the site root %s", dir, root)
	}
	if b.cfg.Helper == "" {
		return errors.New("root-owned site data: no helper executable to remove it with")
	}
	bin, err := os.ReadFile(b.cfg.Helper)
	if err != nil {
		return fmt.Errorf("root-owned site data: helper: %w", err)
	}
	if err := requireStatic(b.cfg.Helper); err != nil {
		return fmt.Errorf("root-owned site data: %w", err)
	}
	sum := sha256.Sum256(bin)
	tag := "infermesh-cleanup-helper:" + hex.EncodeToString(sum[:6])
	api := b.cfg.Docker
	if err := importHelper(ctx, api, tag, bin); err != nil {
		return unreachable(fmt.Errorf("root-owned site data: helper image: %w", err))
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.Background(), b.cfg.CallTimeout)
		defer cancel()
		_, _ = api.ImageRemove(rctx, tag, image.RemoveOptions{Force: true, PruneChildren: true})
	}()

	name := fmt.Sprintf("infermesh-%s-%s-cleanup-%s", b.cfg.Layout.Site, b.cfg.Node, newToken()[:8])
	labels := map[string]string{
		LabelManagedBy: ManagedByValue, LabelSite: b.cfg.Layout.Site, LabelNode: b.cfg.Node,
		LabelTarget: b.cfg.Node, LabelRole: "cleanup-helper",
	}
	cmd := append(append([]string{"/helper"}, b.cfg.HelperArgs...), "/target")
	cctx, cancel := context.WithTimeout(ctx, b.cfg.CallTimeout)
	resp, err := api.ContainerCreate(cctx,
		&container.Config{Image: tag, Cmd: cmd, User: "0:0", Labels: labels, NetworkDisabled: true},
		&container.HostConfig{
			NetworkMode: "none",
			Mounts:      []mount.Mount{{Type: mount.TypeBind, Source: dir, Target: "/target"}},
			LogConfig:   container.LogConfig{Type: "json-file"},
		}, nil, nil, name)
	cancel()
	if err != nil {
		return unreachable(wrap("create helper container", name, err))
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.Background(), b.cfg.CallTimeout)
		defer cancel()
		_ = api.ContainerRemove(rctx, resp.ID, container.RemoveOptions{Force: true})
	}()
	sctx, cancel := context.WithTimeout(ctx, b.cfg.CallTimeout)
	err = api.ContainerStart(sctx, resp.ID, container.StartOptions{})
	cancel()
	if err != nil {
		return unreachable(wrap("start helper container", name, err))
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	respC, errC := api.ContainerWait(wctx, resp.ID, container.WaitConditionNotRunning)
	select {
	case w := <-respC:
		if w.StatusCode != 0 {
			return fmt.Errorf("root-owned site data: helper exited with status %d%s", w.StatusCode, helperOutput(ctx, api, resp.ID))
		}
		return nil
	case err := <-errC:
		return unreachable(wrap("wait helper container", name, err))
	}
}

// helperOutput is the helper container's last output, for an error.
func helperOutput(ctx context.Context, api DockerAPI, id string) string {
	rc, err := api.ContainerLogs(ctx, id, container.LogsOptions{ShowStdout: true, ShowStderr: true, Tail: "20"})
	if err != nil {
		return ""
	}
	defer rc.Close()
	var out, errb bytes.Buffer
	_, _ = stdcopy.StdCopy(&out, &errb, rc)
	return ": " + strings.TrimSpace(out.String()+errb.String())
}

// importHelper imports a FROM scratch image holding bin as /helper.
func importHelper(ctx context.Context, api HelperAPI, tag string, bin []byte) error {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "helper", Mode: 0o755, Size: int64(len(bin))}); err != nil {
		return err
	}
	if _, err := tw.Write(bin); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	rc, err := api.ImageImport(ctx, image.ImportSource{Source: &buf, SourceName: "-"}, tag, image.ImportOptions{})
	if err != nil {
		return err
	}
	defer rc.Close()
	_, err = io.Copy(io.Discard, rc)
	return err
}

// requireStatic refuses an executable that needs a dynamic loader: the
// helper image holds nothing else.
func requireStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("helper %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("helper %s is dynamically linked; a static build (make build, CGO_ENABLED=0) can run in the helper container", path)
		}
	}
	return nil
}

// RemoveContents removes everything inside dir, leaving dir itself: what
// the helper executable does inside its container.
func RemoveContents(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
