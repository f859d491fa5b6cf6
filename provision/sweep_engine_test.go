package provision

import (
	"context"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/client"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// socketProxy forwards connections on a unix socket to the real Docker
// socket, once started: until then the socket does not exist and the
// daemon is unreachable through it.
type socketProxy struct {
	path string
	ln   net.Listener
	wg   sync.WaitGroup
}

func (p *socketProxy) start(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("unix", p.path)
	if err != nil {
		t.Fatal(err)
	}
	p.ln = ln
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer c.Close()
				d, err := net.Dial("unix", "/var/run/docker.sock")
				if err != nil {
					return
				}
				defer d.Close()
				done := make(chan struct{}, 2)
				go func() { io.Copy(d, c); done <- struct{}{} }()
				go func() { io.Copy(c, d); done <- struct{}{} }()
				<-done
			}()
		}
	}()
}

func (p *socketProxy) stop() {
	if p.ln != nil {
		p.ln.Close()
	}
	p.wg.Wait()
}

// TestSweeperRetriesUntilItSucceeded: the agent's orphan sweep binds Docker;
// while the daemon is unreachable every sweep fails and is retried with
// backoff, and the first one after it answers removes the orphan.
func TestSweeperRetriesUntilItSucceeded(t *testing.T) {
	site := engineSite(t)
	ctx := context.Background()
	orphan, err := newTestProvider(t, testClient(t), site, "n1").CreateInstance(ctx, demoSpec("old", 1), Discard)
	if err != nil {
		t.Fatal(err)
	}
	proxy := &socketProxy{path: filepath.Join(t.TempDir(), "docker.sock")}
	t.Cleanup(proxy.stop)
	cli, err := NewDockerClient(client.WithHost("unix://" + proxy.path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	b, err := NewSiteCleanups(SiteCleanupsConfig{
		Docker: cli, Node: "n1", StopTimeout: time.Second,
		Layout: cleanup.Layout{StateDir: t.TempDir(), CacheRoot: t.TempDir(), Site: site},
	})
	if err != nil {
		t.Fatal(err)
	}
	sc, err := b.SiteCleanup(cleanup.NewKindSet(cleanup.Docker))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var outcomes []error
	sw, err := cleanup.NewSweeper(cleanup.SweeperConfig{
		Cleanup: sc, Site: site, Node: "n1", Grace: time.Nanosecond,
		RetryBackoff: 50 * time.Millisecond, Interval: time.Hour,
		Wanted: func() (map[string]bool, error) { return map[string]bool{}, nil },
		OnSweep: func(_ cleanup.Report, err error) {
			mu.Lock()
			outcomes = append(outcomes, err)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); sw.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	failures := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(outcomes)
	}
	testproc.WaitUntil(t, "two failed sweeps", 30*time.Second, func() bool { return failures() >= 2 })
	if sw.Succeeded() {
		t.Fatal("Succeeded() while the daemon is unreachable")
	}
	mu.Lock()
	for _, err := range outcomes {
		if err == nil {
			t.Errorf("a sweep succeeded through a dead socket")
		}
	}
	mu.Unlock()
	proxy.start(t)
	testproc.WaitUntil(t, "a successful sweep", 30*time.Second, sw.Succeeded)
	if _, err := testClient(t).ContainerInspect(ctx, orphan.ResourceID); !cerrdefs.IsNotFound(err) {
		t.Errorf("orphan still there after the sweep succeeded: %v", err)
	}
}
