package provision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"
)

// fakeDocker is an in-memory DockerAPI for the provider's error branches.
// Unset hooks behave like an empty engine.
type fakeDocker struct {
	mu    sync.Mutex
	calls []string

	create  func(name string) (container.CreateResponse, error)
	inspect func(ref string) (container.InspectResponse, error)
	list    func(container.ListOptions) ([]container.Summary, error)
	stop    func(id string) error
	remove  func(id string) error
	wait    func(n int) (container.WaitResponse, error) // n: call number
	waits   int
}

var _ DockerAPI = (*fakeDocker)(nil)

func (f *fakeDocker) record(format string, args ...any) {
	f.mu.Lock()
	f.calls = append(f.calls, fmt.Sprintf(format, args...))
	f.mu.Unlock()
}

func (f *fakeDocker) called(prefix string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, c := range f.calls {
		if strings.HasPrefix(c, prefix) {
			out = append(out, c)
		}
	}
	return out
}

func (f *fakeDocker) ContainerCreate(_ context.Context, _ *container.Config, _ *container.HostConfig, _ *networkConfig, _ *platform, name string) (container.CreateResponse, error) {
	f.record("create %s", name)
	if f.create != nil {
		return f.create(name)
	}
	return container.CreateResponse{ID: "new-" + name}, nil
}

func (f *fakeDocker) ContainerStart(_ context.Context, id string, _ container.StartOptions) error {
	f.record("start %s", id)
	return nil
}

func (f *fakeDocker) ContainerStop(_ context.Context, id string, _ container.StopOptions) error {
	f.record("stop %s", id)
	if f.stop != nil {
		return f.stop(id)
	}
	return nil
}

func (f *fakeDocker) ContainerRemove(_ context.Context, id string, _ container.RemoveOptions) error {
	f.record("remove %s", id)
	if f.remove != nil {
		return f.remove(id)
	}
	return nil
}

func (f *fakeDocker) ContainerInspect(_ context.Context, ref string) (container.InspectResponse, error) {
	f.record("inspect %s", ref)
	if f.inspect != nil {
		return f.inspect(ref)
	}
	return container.InspectResponse{}, fmt.Errorf("no such container %s: %w", ref, cerrdefs.ErrNotFound)
}

func (f *fakeDocker) ContainerList(_ context.Context, o container.ListOptions) ([]container.Summary, error) {
	f.record("list")
	if f.list != nil {
		return f.list(o)
	}
	return nil, nil
}

func (f *fakeDocker) ContainerLogs(ctx context.Context, id string, _ container.LogsOptions) (io.ReadCloser, error) {
	f.record("logs %s", id)
	return io.NopCloser(strings.NewReader("")), nil
}

func (f *fakeDocker) ContainerWait(ctx context.Context, id string, _ container.WaitCondition) (<-chan container.WaitResponse, <-chan error) {
	f.record("wait %s", id)
	respC, errC := make(chan container.WaitResponse, 1), make(chan error, 1)
	f.mu.Lock()
	f.waits++
	n := f.waits
	f.mu.Unlock()
	if f.wait == nil {
		go func() { <-ctx.Done(); errC <- ctx.Err() }()
		return respC, errC
	}
	resp, err := f.wait(n)
	if err != nil {
		errC <- err
	} else {
		respC <- resp
	}
	return respC, errC
}

func fakeProvider(t *testing.T, f *fakeDocker) *DockerProvider {
	t.Helper()
	p, err := NewDockerProvider(f, DockerConfig{Site: "s", Node: "n1", StopTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func labeled(p *DockerProvider, spec ProvisionSpec, mutate func(map[string]string)) map[string]string {
	l := p.labels(spec)
	if mutate != nil {
		mutate(l)
	}
	return l
}

func existing(id string, labels map[string]string, running bool) container.InspectResponse {
	return container.InspectResponse{
		ContainerJSONBase: &container.ContainerJSONBase{ID: id, State: &container.State{Running: running, StartedAt: "2026-01-01T00:00:00Z"}},
		Config:            &container.Config{Labels: labels},
	}
}

var errConflict = fmt.Errorf("name in use: %w", cerrdefs.ErrConflict)

func TestFakeCreateOnNameConflict(t *testing.T) {
	spec := demoSpec("chat", 1)
	tests := []struct {
		name       string
		labels     func(*DockerProvider) map[string]string
		running    bool
		wantErr    error
		wantID     string
		wantRemove bool
	}{
		{"foreign container is never touched",
			func(*DockerProvider) map[string]string { return map[string]string{"app": "x"} }, true, ErrNotOwned, "", false},
		{"another node's labels fail closed",
			func(p *DockerProvider) map[string]string {
				return labeled(p, spec, func(l map[string]string) { l[LabelNode] = "n2" })
			}, true, ErrNotOwned, "", false},
		{"same spec running is adopted",
			func(p *DockerProvider) map[string]string { return labeled(p, spec, nil) }, true, nil, "old", false},
		{"same spec stopped is replaced",
			func(p *DockerProvider) map[string]string { return labeled(p, spec, nil) }, false, nil, "new-infermesh-s-n1-chat-1", true},
		{"stale spec is replaced",
			func(p *DockerProvider) map[string]string {
				return labeled(p, spec, func(l map[string]string) { l[LabelSpecHash] = "stale" })
			}, true, nil, "new-infermesh-s-n1-chat-1", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeDocker{}
			p := fakeProvider(t, f)
			removed := false
			f.create = func(name string) (container.CreateResponse, error) {
				if !removed {
					return container.CreateResponse{}, errConflict
				}
				return container.CreateResponse{ID: "new-" + name}, nil
			}
			f.inspect = func(string) (container.InspectResponse, error) {
				if removed {
					return container.InspectResponse{}, cerrdefs.ErrNotFound
				}
				return existing("old", tt.labels(p), tt.running), nil
			}
			f.remove = func(string) error { removed = true; return nil }

			h, err := p.CreateInstance(context.Background(), spec, Discard)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("CreateInstance error = %v, want %v", err, tt.wantErr)
			}
			if h.ResourceID != tt.wantID {
				t.Errorf("id = %q, want %q", h.ResourceID, tt.wantID)
			}
			if got := len(f.called("remove")) > 0; got != tt.wantRemove {
				t.Errorf("removed = %v, want %v (calls %v)", got, tt.wantRemove, f.calls)
			}
			if tt.wantErr != nil && len(f.called("stop")) > 0 {
				t.Errorf("stopped a container that is not ours")
			}
		})
	}
}

func TestFakeDaemonUnreachableIsMarked(t *testing.T) {
	down := client.ErrorConnectionFailed("unix:///run/dead.sock")
	f := &fakeDocker{
		create:  func(string) (container.CreateResponse, error) { return container.CreateResponse{}, down },
		inspect: func(string) (container.InspectResponse, error) { return container.InspectResponse{}, down },
		list:    func(container.ListOptions) ([]container.Summary, error) { return nil, down },
	}
	p := fakeProvider(t, f)
	ctx := context.Background()
	spec := demoSpec("chat", 1)
	checks := map[string]error{}
	_, checks["CreateInstance"] = p.CreateInstance(ctx, spec, Discard)
	_, _, checks["AdoptBySpec"] = p.AdoptBySpec(ctx, spec, Discard)
	_, checks["StopBySpec"] = p.StopBySpec(ctx, spec, Discard)
	_, checks["ListManaged"] = p.ListManaged(ctx)
	_, checks["Status"] = p.Status(ctx, "x")
	for name, err := range checks {
		if !errors.Is(err, ErrDaemonUnreachable) || !strings.Contains(err.Error(), "dead.sock") {
			t.Errorf("%s error = %v, want ErrDaemonUnreachable naming the socket", name, err)
		}
	}
}

func TestFakeStopPaths(t *testing.T) {
	spec := demoSpec("chat", 1)
	tests := []struct {
		name      string
		inspect   func(p *DockerProvider) (container.InspectResponse, error)
		stopErr   error
		removeErr error
		wantFound bool
		wantErr   string
		wantRm    bool
	}{
		{"already gone", func(*DockerProvider) (container.InspectResponse, error) {
			return container.InspectResponse{}, cerrdefs.ErrNotFound
		}, nil, nil, false, "", false},
		{"vanishes between inspect and remove", func(p *DockerProvider) (container.InspectResponse, error) {
			return existing("c1", labeled(p, spec, nil), true), nil
		}, nil, cerrdefs.ErrNotFound, true, "", true},
		{"stop fails: not removed", func(p *DockerProvider) (container.InspectResponse, error) {
			return existing("c1", labeled(p, spec, nil), true), nil
		}, errors.New("boom"), nil, false, "boom", false},
		{"not ours", func(p *DockerProvider) (container.InspectResponse, error) {
			return existing("c1", labeled(p, spec, func(l map[string]string) { l[LabelSite] = "other" }), true), nil
		}, nil, nil, false, ErrNotOwned.Error(), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeDocker{
				stop:   func(string) error { return tt.stopErr },
				remove: func(string) error { return tt.removeErr },
			}
			p := fakeProvider(t, f)
			f.inspect = func(string) (container.InspectResponse, error) { return tt.inspect(p) }
			found, err := p.StopBySpec(context.Background(), spec, Discard)
			if found != tt.wantFound || (tt.wantErr == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("StopBySpec = %v, %v, want %v, error containing %q", found, err, tt.wantFound, tt.wantErr)
			}
			if got := len(f.called("remove")) > 0; got != tt.wantRm {
				t.Errorf("remove called = %v, want %v", got, tt.wantRm)
			}
		})
	}
}

func TestFakeListManagedRechecksLabels(t *testing.T) {
	f := &fakeDocker{}
	p := fakeProvider(t, f)
	ours := labeled(p, demoSpec("chat", 2), nil)
	mod := func(k, v string) map[string]string {
		return labeled(p, demoSpec("x", 1), func(l map[string]string) {
			if v == "" {
				delete(l, k)
			} else {
				l[k] = v
			}
		})
	}
	var gotFilters []string
	f.list = func(o container.ListOptions) ([]container.Summary, error) {
		gotFilters = o.Filters.Get("label")
		// A daemon that ignored the filter: the provider must not trust it.
		return []container.Summary{
			{ID: "1", Names: []string{"/infermesh-s-n1-chat-2"}, Labels: ours, State: "running"},
			{ID: "2", Names: []string{"/a"}, Labels: mod(LabelNode, "n2")},
			{ID: "3", Names: []string{"/b"}, Labels: mod(LabelSite, "other")},
			{ID: "4", Names: []string{"/c"}, Labels: mod(LabelManagedBy, "")},
			{ID: "5", Names: []string{"/d"}, Labels: mod(LabelManagedBy, "someone-else")},
			{ID: "6", Names: []string{"/e"}, Labels: nil},
		}, nil
	}
	got, err := p.ListManaged(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].ID != "1" || got[0].Ref != "infermesh-s-n1-chat-2" || got[0].Role != "chat" || got[0].Attempt != 2 {
		t.Errorf("ListManaged = %+v, want only container 1 (chat, attempt 2)", got)
	}
	want := []string{LabelManagedBy + "=" + ManagedByValue, LabelSite + "=s", LabelNode + "=n1"}
	for _, w := range want {
		found := false
		for _, g := range gotFilters {
			found = found || g == w
		}
		if !found {
			t.Errorf("label filters %v lack %q", gotFilters, w)
		}
	}
}

func TestFakeExitWatchSurvivesLostConnection(t *testing.T) {
	spec := demoSpec("chat", 1)
	f := &fakeDocker{
		wait: func(n int) (container.WaitResponse, error) {
			if n == 1 {
				return container.WaitResponse{}, client.ErrorConnectionFailed("unix:///x.sock")
			}
			return container.WaitResponse{StatusCode: 7}, nil
		},
	}
	_, rec := adoptRunning(t, f, spec)
	exit, seen := rec.waitFor(t, 5*time.Second, func(o Observation) bool { return o.Kind == ObsExited })
	if exit.Status == nil || *exit.Status != 7 {
		t.Errorf("exit status = %v, want 7", exit.Status)
	}
	lost := false
	for _, o := range seen {
		lost = lost || o.Kind == ObsProvider && strings.Contains(o.Line, ErrDaemonUnreachable.Error())
	}
	if !lost {
		t.Errorf("no provider line about the lost exit watch; saw %+v", seen)
	}
}

// adoptRunning adopts spec's container, running in f as "c1", so that its
// exit watch starts, and returns the provider and what it observes.
func adoptRunning(t *testing.T, f *fakeDocker, spec ProvisionSpec) (*DockerProvider, *recorder) {
	t.Helper()
	p := fakeProvider(t, f)
	f.inspect = func(string) (container.InspectResponse, error) {
		return existing("c1", labeled(p, spec, nil), true), nil
	}
	rec := newRecorder()
	if _, ok, err := p.AdoptBySpec(context.Background(), spec, rec); !ok || err != nil {
		t.Fatalf("AdoptBySpec = %v, %v", ok, err)
	}
	return p, rec
}

// A container removed while its watch was reconnecting (the engine only
// says "no such container") is a failure: the instance was lost, and the
// watch ends instead of retrying forever.
func TestFakeExitWatchReportsVanishedContainer(t *testing.T) {
	spec := demoSpec("chat", 1)
	f := &fakeDocker{
		wait: func(int) (container.WaitResponse, error) {
			return container.WaitResponse{}, fmt.Errorf("no such container: %w", cerrdefs.ErrNotFound)
		},
	}
	p, rec := adoptRunning(t, f, spec)
	end, _ := rec.waitFor(t, 5*time.Second, func(o Observation) bool { return o.Kind == ObsExited || o.Kind == ObsFailed })
	if end.Kind != ObsFailed || !strings.Contains(end.Reason, "vanished") || end.Status != nil {
		t.Errorf("end = %v %q status %v, want failed: vanished, no status", end.Kind, end.Reason, end.Status)
	}
	p.Close() // waits for the watch goroutines
	if n := len(f.called("wait")); n != 1 {
		t.Errorf("wait called %d times, want once: nothing is left to wait for", n)
	}
}

func TestDockerConfigValidation(t *testing.T) {
	tests := []struct {
		name    string
		cfg     DockerConfig
		wantErr string
	}{
		{"ok", DockerConfig{Site: "default", Node: "a"}, ""},
		{"no site", DockerConfig{Node: "a"}, "Site"},
		{"no node", DockerConfig{Site: "s"}, "Node"},
		{"bad site", DockerConfig{Site: "a/b", Node: "a"}, "Site"},
		{"bad node", DockerConfig{Site: "s", Node: "a b"}, "Node"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewDockerProvider(&fakeDocker{}, tt.cfg)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("NewDockerProvider = %v", err)
				}
				p.Close()
				p.Close() // idempotent
				if got := p.Config(); got.StopTimeout != 10*time.Second || got.Target != "docker" || got.LogTail != 100 {
					t.Errorf("defaults not filled: %+v", got)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("NewDockerProvider = %v, want error naming %s", err, tt.wantErr)
			}
		})
	}
	if _, err := NewDockerProvider(nil, DockerConfig{Site: "s", Node: "n"}); err == nil {
		t.Errorf("NewDockerProvider(nil api) succeeded")
	}
}

func TestManagerConfigAndApplyValidation(t *testing.T) {
	p := fakeProvider(t, &fakeDocker{})
	reg := nopRegistrar{}
	in := memIntents{}
	for name, cfg := range map[string]ManagerConfig{
		"Provider":  {Intents: in, Registrar: reg},
		"Intents":   {Provider: p, Registrar: reg},
		"Registrar": {Provider: p, Intents: in},
	} {
		if _, err := NewManager(cfg); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("NewManager without %s = %v, want an error naming it", name, err)
		}
	}
	m, err := NewManager(ManagerConfig{Provider: p, Intents: in, Registrar: reg})
	if err != nil {
		t.Fatal(err)
	}
	good := InstanceSpec{Image: "i", Port: 8080}
	tests := []struct {
		name    string
		role    string
		spec    InstanceSpec
		wantErr string
	}{
		{"ok", "chat", good, ""},
		{"bad role", "a/b", good, "a/b"},
		{"no image", "chat", InstanceSpec{Port: 1}, "image"},
		{"port", "chat", InstanceSpec{Image: "i"}, "port"},
		{"health", "chat", InstanceSpec{Image: "i", Port: 1, Health: "health"}, "health"},
		{"mount", "chat", InstanceSpec{Image: "i", Port: 1, Mounts: []Mount{{HostPath: "rel", ContainerPath: "/x"}}}, "mounts[0]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := m.Apply(context.Background(), map[string]InstanceSpec{tt.role: tt.spec})
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("Apply = %v, want error containing %q", err, tt.wantErr)
			}
		})
	}
}

type nopRegistrar struct{}

func (nopRegistrar) RegisterLocal(string, placementLocal) error { return nil }
func (nopRegistrar) DeregisterLocal(string)                     {}

type memIntents map[string]ProvisionSpec

func (m memIntents) PutIntent(ref string, s ProvisionSpec) error { m[ref] = s; return nil }
func (m memIntents) DeleteIntent(ref string) error               { delete(m, ref); return nil }
func (m memIntents) Intents() (map[string]ProvisionSpec, error)  { return m, nil }

func TestManagerRunTwiceAndCancel(t *testing.T) {
	p := fakeProvider(t, &fakeDocker{})
	m, err := NewManager(ManagerConfig{Provider: p, Intents: memIntents{}, Registrar: nopRegistrar{}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		m.mu.Lock()
		running := m.running
		m.mu.Unlock()
		if running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Run never started")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := m.Run(ctx); !errors.Is(err, ErrRunning) {
		t.Errorf("second Run = %v, want ErrRunning", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run after cancel = %v, want nil", err)
	}
}
