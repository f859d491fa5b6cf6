package provision

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/infermesh/infermesh/internal/testing/testimage"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"
	"go.etcd.io/bbolt"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/store"
)

// mgrRun is a running Manager over the intents of a real state store and
// a real placement table, recording its events: one
// agent's worth of provisioning, whatever its providers.
type mgrRun struct {
	t       *testing.T
	dbPath  string
	st      *store.Store
	intents *BoltIntents
	table   *placement.Table
	m       *Manager
	closeP  func() // closes the providers

	mu     sync.Mutex
	events []Event

	cancel context.CancelFunc
	done   chan error
}

func managerConfigForTest() ManagerConfig {
	return ManagerConfig{
		ProbeInterval:   100 * time.Millisecond,
		ProbeTimeout:    500 * time.Millisecond,
		ReadyTimeout:    20 * time.Second,
		UnhealthyAfter:  2,
		RetryBackoff:    100 * time.Millisecond,
		MaxRetryBackoff: 400 * time.Millisecond,
		OpTimeout:       30 * time.Second,
	}
}

// startManager runs a Manager of providers over the intent store at dbPath
// ("" = a new one); stop (or the test's end) closes the providers with
// closeP.
func startManager(t *testing.T, dbPath string, providers map[string]InstanceProvider, closeP func()) *mgrRun {
	t.Helper()
	r := &mgrRun{t: t, dbPath: dbPath, closeP: closeP}
	if r.dbPath == "" {
		r.dbPath = filepath.Join(t.TempDir(), "state.db")
	}
	st, err := store.Open(r.dbPath, store.Options{LockTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	r.st = st
	if r.intents, err = NewBoltIntents(st); err != nil {
		t.Fatal(err)
	}
	if r.table, err = placement.New(placement.Config{NodeID: "n1"}); err != nil {
		t.Fatal(err)
	}
	cfg := managerConfigForTest()
	cfg.Providers, cfg.Intents, cfg.Registrar = providers, r.intents, r.table
	cfg.Events = func(ev Event) {
		r.mu.Lock()
		r.events = append(r.events, ev)
		r.mu.Unlock()
	}
	if r.m, err = NewManager(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.done = cancel, make(chan error, 1)
	go func() { r.done <- r.m.Run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

// stop ends the manager (instances keep running), closes the providers
// and the store. Idempotent.
func (r *mgrRun) stop() { r.stopThen(nil) }

// stopThen ends the manager, runs then (the manager's Run has returned,
// its providers and store are still open), then closes them. Idempotent.
func (r *mgrRun) stopThen(then func()) {
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	select {
	case err := <-r.done:
		if err != nil {
			r.t.Errorf("Run = %v, want nil on cancel", err)
		}
	case <-time.After(30 * time.Second):
		r.t.Errorf("Run did not return after cancel")
	}
	if then != nil {
		then()
	}
	r.closeP()
	r.st.Close()
}

func (r *mgrRun) apply(desired map[string]InstanceSpec) {
	r.t.Helper()
	if err := r.m.Apply(context.Background(), desired); err != nil {
		r.t.Fatalf("Apply: %v", err)
	}
}

func (r *mgrRun) hasEvent(kind EventKind, substr string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ev := range r.events {
		if ev.Kind == kind && strings.Contains(ev.Message, substr) {
			return true
		}
	}
	return false
}

// waitInstance polls role's status until pred holds.
func (r *mgrRun) waitInstance(role, what string, pred func(InstanceStatus, bool) bool) InstanceStatus {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, ok := r.m.Instance(role)
		if pred(st, ok) {
			return st
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("instance %s never became %s; last %+v (present %v)", role, what, st, ok)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *mgrRun) waitReady(role string, pred func(InstanceStatus) bool) InstanceStatus {
	r.t.Helper()
	return r.waitInstance(role, "ready", func(st InstanceStatus, ok bool) bool {
		return ok && st.State == StateReady && (pred == nil || pred(st))
	})
}

// mgrEnv is a Manager of Docker instances against the real engine.
type mgrEnv struct {
	*mgrRun
	site string
	api  DockerAPI
	cli  *DockerClient
	p    *DockerProvider
}

// newMgrEnv starts a Manager for site over the intent store at dbPath
// ("" = a new one). api nil means the real client.
func newMgrEnv(t *testing.T, site, dbPath string, api DockerAPI) *mgrEnv {
	t.Helper()
	e := &mgrEnv{site: site, cli: testClient(t), api: api}
	if e.api == nil {
		e.api = e.cli
	}
	e.p = newTestProvider(t, e.api, site, "n1")
	e.mgrRun = startManager(t, dbPath, docker(e.p), func() { e.p.Close() })
	return e
}

// sweeper is the agent's orphan sweep over e's manager: Docker bound, node
// n1, the given grace and clock (nil: time.Now).
func (e *mgrEnv) sweeper(t *testing.T, grace time.Duration, now func() time.Time) *cleanup.Sweeper {
	t.Helper()
	api, ok := e.api.(HelperAPI)
	if !ok {
		api = helperless{e.api}
	}
	b, err := NewSiteCleanups(SiteCleanupsConfig{
		Docker: api, Node: "n1", StopTimeout: time.Second,
		Layout: cleanup.Layout{StateDir: t.TempDir(), CacheRoot: t.TempDir(), Site: e.site},
	})
	if err != nil {
		t.Fatal(err)
	}
	sc, err := b.SiteCleanup(cleanup.NewKindSet(cleanup.Docker))
	if err != nil {
		t.Fatal(err)
	}
	sw, err := cleanup.NewSweeper(cleanup.SweeperConfig{Cleanup: sc, Site: e.site, Node: "n1", Wanted: e.m.Wanted, Grace: grace, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	return sw
}

// helperless adds HelperAPI's image calls to a DockerAPI, failing them.
type helperless struct{ DockerAPI }

func (helperless) ImageImport(context.Context, image.ImportSource, string, image.ImportOptions) (io.ReadCloser, error) {
	return nil, errors.New("no images here")
}

func (helperless) ImageRemove(context.Context, string, image.RemoveOptions) ([]image.DeleteResponse, error) {
	return nil, errors.New("no images here")
}

func instanceSpec(model string) InstanceSpec {
	return InstanceSpec{
		Image:   testImage,
		Args:    []string{"/infermesh-demo", "-listen", "0.0.0.0:8080", "-model", model},
		Port:    8080,
		Model:   model,
		Restart: RestartPolicy{Max: 2, Window: time.Minute, Backoff: 50 * time.Millisecond},
	}
}

// chat posts a chat completion to an OpenAI base URL (".../v1").
func chat(t *testing.T, base, model string) {
	t.Helper()
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`
	resp, err := http.Post(base+"/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("chat completion via %s: %v", base, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("chat completion via %s = %d, want 200", base, resp.StatusCode)
	}
}

func TestManagerServesRestartsWithinPolicyThenGivesUp(t *testing.T) {
	t.Parallel()
	e := newMgrEnv(t, engineSite(t), "", nil)
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st := e.waitReady("chat", nil)

	base, ok := e.table.LocalBaseForRole("chat")
	if got, want := base, "http://"+st.Endpoint+"/v1"; !ok || got != want {
		t.Fatalf("placement base = %q, %v, want %q", got, ok, want)
	}
	chat(t, base, "m-chat")
	if logs := e.m.Logs("chat", 0); !strings.Contains(logsText(logs), "serving demo model") {
		t.Errorf("Logs(chat) = %q, want the model's startup line", logsText(logs))
	}

	id := st.ContainerID
	for i := 1; i <= 2; i++ {
		if err := testimage.Engine(t).ContainerKill(context.Background(), id, "SIGKILL"); err != nil {
			t.Fatalf("kill #%d: %v", i, err)
		}
		st = e.waitReady("chat", func(s InstanceStatus) bool { return s.Restarts == i })
		if st.ContainerID != id {
			t.Errorf("restart #%d: container %s, want %s restarted in place", i, st.ContainerID, id)
		}
		base, ok := e.table.LocalBaseForRole("chat")
		if got, want := base, "http://"+st.Endpoint+"/v1"; !ok || got != want {
			t.Fatalf("after restart #%d placement base = %q, %v, want %q", i, got, ok, want)
		}
		chat(t, base, "m-chat")
	}
	if !e.hasEvent(EventInstanceStopped, "exited with status 137") {
		t.Errorf("no instance_stopped event for the kill")
	}

	// A third exit within the window is over the policy: given up.
	if err := testimage.Engine(t).ContainerKill(context.Background(), id, "SIGKILL"); err != nil {
		t.Fatal(err)
	}
	st = e.waitInstance("chat", "failed", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateFailed })
	if !strings.Contains(st.LastError, "gave up") || st.LastEvent.Kind != EventProvisionFailed {
		t.Errorf("failed status = %+v, want a gave-up provision_failed event", st)
	}
	if !e.hasEvent(EventProvisionFailed, "gave up after 2 restarts") {
		t.Errorf("no provision_failed event the operator can see")
	}
	if _, ok := e.table.LocalBaseForRole("chat"); ok {
		t.Errorf("failed instance still registered in placement")
	}

	// The operator retries it: the same container is started again under a
	// fresh restart policy, and serves.
	if err := e.m.Retry("ghost"); !errors.Is(err, ErrNoInstance) {
		t.Errorf("Retry(ghost) = %v, want ErrNoInstance", err)
	}
	if err := e.m.Retry("chat"); err != nil {
		t.Fatalf("Retry(chat): %v", err)
	}
	st = e.waitReady("chat", nil)
	if st.ContainerID != id || st.Restarts != 0 {
		t.Errorf("after retry: container %s with %d restarts, want %s with a fresh policy", st.ContainerID, st.Restarts, id)
	}
	base, ok = e.table.LocalBaseForRole("chat")
	if !ok {
		t.Fatal("retried instance not registered in placement")
	}
	chat(t, base, "m-chat")
	if err := e.m.Retry("chat"); !errors.Is(err, ErrNotFailed) {
		t.Errorf("Retry of a serving instance = %v, want ErrNotFailed", err)
	}
}

func logsText(lines []LogLine) string {
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l.Stream + ": " + l.Line + "\n")
	}
	return b.String()
}

func TestManagerAdoptsAcrossAgentRestartWithoutGap(t *testing.T) {
	t.Parallel()
	site := engineSite(t)
	e1 := newMgrEnv(t, site, "", nil)
	e1.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st1 := e1.waitReady("chat", nil)
	info1, err := e1.cli.ContainerInspect(context.Background(), st1.ContainerID)
	if err != nil {
		t.Fatal(err)
	}

	// Keep asking the instance while the agent restarts.
	var probes, failures atomic.Int64
	stopProbe := make(chan struct{})
	probeDone := make(chan struct{})
	go func() {
		defer close(probeDone)
		c := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		for {
			select {
			case <-stopProbe:
				return
			case <-time.After(20 * time.Millisecond):
			}
			probes.Add(1)
			resp, err := c.Get("http://" + st1.Endpoint + "/health")
			if err != nil || resp.StatusCode != http.StatusOK {
				failures.Add(1)
			}
			if err == nil {
				resp.Body.Close()
			}
		}
	}()

	e1.stop()
	e2 := newMgrEnv(t, site, e1.dbPath, nil)
	e2.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st2 := e2.waitReady("chat", nil)
	close(stopProbe)
	<-probeDone

	if st2.ContainerID != st1.ContainerID {
		t.Errorf("after restart container = %s, want adopted %s", st2.ContainerID, st1.ContainerID)
	}
	info2, err := e2.cli.ContainerInspect(context.Background(), st2.ContainerID)
	if err != nil {
		t.Fatal(err)
	}
	if info2.State.StartedAt != info1.State.StartedAt || info2.RestartCount != info1.RestartCount {
		t.Errorf("container restarted: started %s -> %s", info1.State.StartedAt, info2.State.StartedAt)
	}
	if st2.Restarts != 0 || !e2.hasEvent(EventProvisionStart, "adopted running container") {
		t.Errorf("status %+v: want adopted, 0 restarts", st2)
	}
	if n := failures.Load(); n != 0 {
		t.Errorf("%d of %d health requests failed during the agent restart", n, probes.Load())
	}
	refs, err := e2.p.ListManagedRefs(context.Background())
	if err != nil || len(refs) != 1 {
		t.Errorf("managed containers = %v, %v, want exactly one", refs, err)
	}
	if base, ok := e2.table.LocalBaseForRole("chat"); !ok || base != "http://"+st2.Endpoint+"/v1" {
		t.Errorf("placement base = %q, %v after adoption", base, ok)
	}
}

func TestManagerReplacesOnSpecChangeAndRemovesRole(t *testing.T) {
	t.Parallel()
	e := newMgrEnv(t, engineSite(t), "", nil)
	ctx := context.Background()
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-one")})
	st1 := e.waitReady("chat", nil)
	if st1.Attempt != 1 {
		t.Errorf("first attempt = %d, want 1", st1.Attempt)
	}

	// Only the model the placement entry carries changes: same container.
	same := instanceSpec("m-one")
	same.Model = "m-one-alias"
	e.apply(map[string]InstanceSpec{"chat": same})
	e.waitInstance("chat", "re-registered", func(s InstanceStatus, ok bool) bool {
		c := e.table.Resolve("chat")
		return ok && s.State == StateReady && len(c) == 1 && c[0].Model == "m-one-alias"
	})
	if st, _ := e.m.Instance("chat"); st.ContainerID != st1.ContainerID || st.Restarts != 0 {
		t.Errorf("model-only change: %+v, want the same container, not restarted", st)
	}

	// The container itself changes: replaced (old stopped first).
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-two")})
	st2 := e.waitReady("chat", func(s InstanceStatus) bool { return s.Attempt == 2 })
	if st2.ContainerID == st1.ContainerID || st2.Ref == st1.Ref {
		t.Fatalf("not replaced: %+v", st2)
	}
	if _, err := e.cli.ContainerInspect(ctx, st1.ContainerID); !cerrdefs.IsNotFound(err) {
		t.Errorf("old container inspect = %v, want not found", err)
	}
	intents, err := e.intents.Intents()
	if err != nil || len(intents) != 1 || intents[st2.Ref].AttemptID != 2 {
		t.Errorf("intents = %v, %v, want only %s", intents, err, st2.Ref)
	}
	base, _ := e.table.LocalBaseForRole("chat")
	chat(t, base, "m-two")

	// The role goes away: container stopped and removed, intent dropped.
	e.apply(map[string]InstanceSpec{})
	e.waitInstance("chat", "gone", func(_ InstanceStatus, ok bool) bool { return !ok })
	if _, err := e.cli.ContainerInspect(ctx, st2.ContainerID); !cerrdefs.IsNotFound(err) {
		t.Errorf("removed role's container inspect = %v, want not found", err)
	}
	if intents, _ := e.intents.Intents(); len(intents) != 0 {
		t.Errorf("intents after removal = %v, want none", intents)
	}
	if _, ok := e.table.LocalBaseForRole("chat"); ok {
		t.Errorf("removed role still registered")
	}
}

func TestManagerSweepOrphans(t *testing.T) {
	t.Parallel()
	site, otherSite := engineSite(t), engineSite(t)
	e := newMgrEnv(t, site, "", nil)
	ctx := context.Background()
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	wanted := e.waitReady("chat", nil)

	// An orphan with our labels (no intent), another node's, another
	// site's, and an unlabeled container.
	orphan, err := e.p.CreateInstance(ctx, demoSpec("old", 3), Discard)
	if err != nil {
		t.Fatal(err)
	}
	otherNode, err := newTestProvider(t, e.cli, site, "n2").CreateInstance(ctx, demoSpec("old", 3), Discard)
	if err != nil {
		t.Fatal(err)
	}
	otherSiteH, err := newTestProvider(t, e.cli, otherSite, "n1").CreateInstance(ctx, demoSpec("old", 3), Discard)
	if err != nil {
		t.Fatal(err)
	}
	unlabeled := "infermesh-" + site + "-n1-unlabeled-1"
	removeByName(t, e.cli, unlabeled)
	if _, err := e.cli.ContainerCreate(ctx, &container.Config{Image: testImage}, nil, nil, nil, unlabeled); err != nil {
		t.Fatal(err)
	}
	// Containers an older agent created, whose target label says "docker":
	// attributed to their node label, so n1's is this agent's orphan and
	// n2's is not.
	legacy := func(node string) string {
		p := newTestProvider(t, e.cli, site, node)
		spec := demoSpec("legacy", 1)
		cc, hc := p.buildConfig(spec)
		cc.Labels[LabelTarget] = LegacyTargetDocker
		resp, err := e.cli.ContainerCreate(ctx, cc, hc, nil, nil, p.ProviderRef(spec))
		if err != nil {
			t.Fatal(err)
		}
		return resp.ID
	}
	legacyMine, legacyTheirs := legacy("n1"), legacy("n2")

	// The agent's sweep: targets n1 of the site, keeping what the manager
	// wants and what is younger than the grace period.
	now := time.Now()
	sw := e.sweeper(t, time.Hour, func() time.Time { return now })
	rep, err := sw.Sweep(ctx)
	if err != nil {
		t.Fatalf("Sweep within the grace period: %v", err)
	}
	if len(rep.Removed) != 0 {
		t.Fatalf("Sweep within the grace period removed %+v, want nothing", rep.Removed)
	}
	if _, err := e.cli.ContainerInspect(ctx, orphan.ResourceID); err != nil {
		t.Fatalf("a young orphan was removed: %v", err)
	}
	now = now.Add(2 * time.Hour)
	rep, err = sw.Sweep(ctx)
	if err != nil {
		t.Fatalf("Sweep: %v", err)
	}
	if len(rep.Removed) != 2 || rep.Removed[0].ID != legacyMine || rep.Removed[1].Ref != orphan.Ref {
		t.Fatalf("Sweep removed %+v, want only %s and n1's legacy container", rep.Removed, orphan.Ref)
	}
	if !sw.Succeeded() {
		t.Errorf("Succeeded() = false after a clean sweep")
	}
	if _, err := e.cli.ContainerInspect(ctx, orphan.ResourceID); !cerrdefs.IsNotFound(err) {
		t.Errorf("orphan still there after the sweep: %v", err)
	}
	for _, id := range []string{wanted.ContainerID, otherNode.ResourceID, otherSiteH.ResourceID, unlabeled, legacyTheirs} {
		if _, err := e.cli.ContainerInspect(ctx, id); err != nil {
			t.Errorf("container %s touched by the sweep: %v", id, err)
		}
	}
	if st, _ := e.m.Instance("chat"); st.State != StateReady || st.ContainerID != wanted.ContainerID {
		t.Errorf("wanted instance after sweep = %+v", st)
	}
}

func TestManagerRecoversFromCrashBetweenIntentAndCreate(t *testing.T) {
	t.Parallel()
	site := engineSite(t)
	dbPath := filepath.Join(t.TempDir(), "state.db")

	// The previous agent, of the previous release, wrote intents and died
	// before creating anything: one for a role still configured, one for a
	// role since removed. They are in that release's shape ("node_id",
	// "stage_index"), in its bucket (provision.intents) of a file without
	// a policy mirror.
	{
		db, err := bbolt.Open(dbPath, 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		p := newTestProvider(t, testClient(t), site, "n1")
		for role, spec := range map[string]InstanceSpec{"chat": cloneInstanceSpec(instanceSpec("m-chat")), "gone": cloneInstanceSpec(instanceSpec("m-gone"))} {
			ps := spec.provisionSpec(role, 4)
			err := db.Update(func(tx *bbolt.Tx) error {
				b, err := tx.CreateBucketIfNotExists([]byte("provision.intents"))
				if err != nil {
					return err
				}
				return b.Put([]byte(p.ProviderRef(ps)), previousReleaseIntent(t, ps))
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		db.Close()
	}

	e := newMgrEnv(t, site, dbPath, nil)
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st := e.waitReady("chat", nil)
	if st.Attempt != 4 {
		t.Errorf("attempt = %d, want the intent's 4", st.Attempt)
	}
	e.waitInstance("gone", "cleaned up", func(_ InstanceStatus, ok bool) bool { return !ok })
	intents, err := e.intents.Intents()
	if err != nil || len(intents) != 1 || intents[st.Ref].Role != "chat" {
		t.Errorf("intents = %v, %v, want only chat's", intents, err)
	}
	refs, err := e.p.ListManagedRefs(context.Background())
	if err != nil || len(refs) != 1 || refs[0] != st.Ref {
		t.Errorf("managed containers = %v, %v, want only %s", refs, err, st.Ref)
	}
}

func TestManagerDeregistersWhileUnansweredAndReregisters(t *testing.T) {
	t.Parallel()
	e := newMgrEnv(t, engineSite(t), "", nil)
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st := e.waitReady("chat", nil)
	ctx := context.Background()

	if err := testimage.Engine(t).ContainerPause(ctx, st.ContainerID); err != nil {
		t.Fatal(err)
	}
	e.waitInstance("chat", "unhealthy", func(s InstanceStatus, ok bool) bool { return s.State == StateUnhealthy })
	if _, ok := e.table.LocalBaseForRole("chat"); ok {
		t.Errorf("unanswering instance still registered")
	}
	if err := testimage.Engine(t).ContainerUnpause(ctx, st.ContainerID); err != nil {
		t.Fatal(err)
	}
	st2 := e.waitReady("chat", nil)
	if st2.ContainerID != st.ContainerID || st2.Restarts != 0 {
		t.Errorf("after recovery %+v, want the same container, no restart", st2)
	}
	if _, ok := e.table.LocalBaseForRole("chat"); !ok {
		t.Errorf("recovered instance not registered again")
	}
}

// failingCreate fails ContainerCreate for one container name with a
// connection failure while down is set, like a daemon that went away.
type failingCreate struct {
	DockerAPI
	name string
	down atomic.Bool
	hits atomic.Int64
}

func (f *failingCreate) ContainerCreate(ctx context.Context, cc *container.Config, hc *container.HostConfig, nc *networkConfig, pl *platform, name string) (container.CreateResponse, error) {
	if name == f.name && f.down.Load() {
		f.hits.Add(1)
		return container.CreateResponse{}, client.ErrorConnectionFailed("unix:///var/run/docker.sock")
	}
	return f.DockerAPI.ContainerCreate(ctx, cc, hc, nc, pl, name)
}

func TestManagerRuntimeErrorsRetryWhileOtherRolesServe(t *testing.T) {
	t.Parallel()
	site := engineSite(t)
	f := &failingCreate{DockerAPI: testClient(t), name: "infermesh-" + site + "-n1-embed-1"}
	f.down.Store(true)
	e := newMgrEnv(t, site, "", f)
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat"), "embed": instanceSpec("m-embed")})

	e.waitReady("chat", nil)
	st := e.waitInstance("embed", "retrying", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateError && f.hits.Load() >= 3 })
	if !strings.Contains(st.LastError, ErrDaemonUnreachable.Error()) {
		t.Errorf("LastError = %q, want it to say the daemon is unreachable", st.LastError)
	}
	if !e.hasEvent(EventProvisionFailed, ErrDaemonUnreachable.Error()) {
		t.Errorf("no provision_failed event for the unreachable daemon")
	}
	base, _ := e.table.LocalBaseForRole("chat")
	chat(t, base, "m-chat")

	f.down.Store(false)
	e.waitReady("embed", nil)
}

func TestManagerDeadDaemon(t *testing.T) {
	t.Parallel()
	dead := filepath.Join(t.TempDir(), "dead.sock")
	cli, err := client.NewClientWithOpts(client.WithHost("unix://"+dead), client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	e := newMgrEnv(t, "deadsite", "", cli)
	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	st := e.waitInstance("chat", "error", func(s InstanceStatus, ok bool) bool {
		return ok && s.State == StateError && strings.Contains(s.LastError, dead)
	})
	if !strings.Contains(st.LastError, ErrDaemonUnreachable.Error()) {
		t.Errorf("LastError = %q, want it to say the daemon is unreachable", st.LastError)
	}
	// The sweep binds Docker (the manager runs containers): unreachable,
	// it fails closed and has not succeeded.
	sw := e.sweeper(t, time.Nanosecond, nil)
	if _, err := sw.Sweep(context.Background()); !errors.Is(err, cleanup.ErrUnreachable) || !errors.Is(err, ErrDaemonUnreachable) {
		t.Errorf("Sweep = %v, want ErrUnreachable", err)
	}
	if sw.Succeeded() {
		t.Errorf("Succeeded() = true after a failed sweep")
	}
	e.stop() // Run returns nil promptly even while retrying
}

// memLimited creates every container with a memory limit, as an engine
// policy could: the provider sets none.
type memLimited struct {
	DockerAPI
	limit int64

	mu      sync.Mutex
	created []string // container ids, in order
}

func (m *memLimited) ContainerCreate(ctx context.Context, cc *container.Config, hc *container.HostConfig, nc *networkConfig, pl *platform, name string) (container.CreateResponse, error) {
	hc.Resources.Memory, hc.Resources.MemorySwap = m.limit, m.limit
	r, err := m.DockerAPI.ContainerCreate(ctx, cc, hc, nc, pl, name)
	if err == nil {
		m.mu.Lock()
		m.created = append(m.created, r.ID)
		m.mu.Unlock()
	}
	return r, err
}

// engineSawOOM reports whether the engine itself recorded an OOM kill of
// the last container created.
func (m *memLimited) engineSawOOM(t *testing.T) bool {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.created) == 0 {
		return false
	}
	info, err := m.DockerAPI.ContainerInspect(context.Background(), m.created[len(m.created)-1])
	return err == nil && info.State != nil && info.State.OOMKilled
}

// An instance the kernel kills for running out of memory is restarted, and
// given up, with that reason: the operator reads "out of memory", not a
// bare exit status. The engine records an OOM kill from an event of its
// own, and on a loaded host it sometimes records none (its inspect says
// OOMKilled false, as ours does): that is the fault's report failing, not
// the manager, so the fault is run again, at most three times. Whenever
// the engine recorded the kill, the manager must say so.
func TestManagerReportsOOMKills(t *testing.T) {
	t.Parallel()
	api := &memLimited{DockerAPI: testClient(t), limit: 32 << 20}
	e := newMgrEnv(t, engineSite(t), "", api)
	spec := instanceSpec("m-hog")
	spec.Args = []string{"/memhog", "256"}
	spec.Restart = RestartPolicy{Max: 1, Window: time.Minute, Backoff: 50 * time.Millisecond}
	role := "hog"
	var st InstanceStatus
	for attempt := 1; ; attempt++ {
		e.apply(map[string]InstanceSpec{role: spec})
		st = e.waitInstance(role, "failed", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateFailed })
		if strings.Contains(st.LastError, "out of memory") || api.engineSawOOM(t) || attempt == 3 {
			break
		}
		t.Logf("attempt %d: the engine recorded no OOM kill (LastError %q); running the fault again", attempt, st.LastError)
		role = fmt.Sprintf("hog%d", attempt+1)
	}
	if !strings.Contains(st.LastError, "gave up after 1 restarts") || !strings.Contains(st.LastError, "out of memory") {
		t.Errorf("LastError = %q, want it to give up for running out of memory", st.LastError)
	}
	if !e.hasEvent(EventInstanceStopped, "out of memory") {
		t.Errorf("no instance_stopped event saying out of memory")
	}
	// The run's end reaches the log from the container's watch, which may
	// come after the state its inspect gave: wait for the line.
	deadline := time.Now().Add(10 * time.Second)
	for logs := logsText(e.m.Logs(role, 0)); !strings.Contains(logs, "failed: out of memory"); logs = logsText(e.m.Logs(role, 0)) {
		if time.Now().After(deadline) {
			t.Errorf("Logs(%s) = %q, want the failed line", role, logs)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, ok := e.table.LocalBaseForRole(role); ok {
		t.Errorf("an instance that never answered is registered in placement")
	}
}

// previousReleaseIntent is spec as the previous release stored it: the
// instance id under "node_id", and a "stage_index".
func previousReleaseIntent(t *testing.T, spec ProvisionSpec) []byte {
	t.Helper()
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	old := strings.Replace(string(b), `"instance_id":`, `"stage_index":null,"node_id":`, 1)
	if old == string(b) {
		t.Fatalf("no instance_id in %s", b)
	}
	return []byte(old)
}

// TestManagerGivesUpAtOnceOnConfigErrors: an image that is neither on the
// host nor pullable (no registry answers here) and a missing bind-mount
// source cannot be fixed by retrying: the instance is failed at once, with
// one error saying what to do, and no restart is spent. An image present
// on the host is used without a pull.
func TestManagerGivesUpAtOnceOnConfigErrors(t *testing.T) {
	t.Parallel()
	e := newMgrEnv(t, engineSite(t), "", nil)
	missing := "infermesh-ux-test-missing:none"
	noImage := instanceSpec("m-a")
	noImage.Image = missing
	noMount := instanceSpec("m-b")
	noMount.Mounts = []Mount{{HostPath: filepath.Join(t.TempDir(), "no-such-model.gguf"), ContainerPath: "/models/m.gguf", ReadOnly: true}}
	e.apply(map[string]InstanceSpec{"a": noImage, "b": noMount, "c": instanceSpec("m-c")})

	failed := func(s InstanceStatus, ok bool) bool { return ok && s.State == StateFailed }
	st := e.waitInstance("a", "failed", failed)
	if want := "docker pull " + missing; !strings.Contains(st.LastError, want) || !strings.Contains(st.LastError, "image not found") || st.Restarts != 0 {
		t.Errorf("a = %+v; want failed at once, the error saying %q", st, want)
	}
	if !strings.Contains(logsText(e.m.Logs("a", 0)), "is not on this host: pulling it") {
		t.Errorf("a's logs = %q, want the pull attempt", logsText(e.m.Logs("a", 0)))
	}
	st = e.waitInstance("b", "failed", failed)
	if !strings.Contains(st.LastError, "bind-mount source does not exist") || !strings.Contains(st.LastError, "no-such-model.gguf") || st.Restarts != 0 {
		t.Errorf("b = %+v; want failed at once naming the missing mount source", st)
	}
	for _, role := range []string{"a", "b"} {
		if !e.hasEvent(EventProvisionFailed, "gave up") {
			t.Errorf("no provision_failed event for %s", role)
		}
	}
	e.waitReady("c", nil)
	if strings.Contains(logsText(e.m.Logs("c", 0)), "pulling") {
		t.Errorf("c's image is on the host, yet it was pulled: %q", logsText(e.m.Logs("c", 0)))
	}
	// Fixed on the host, the operator retries: it serves.
	if err := os.WriteFile(noMount.Mounts[0].HostPath, []byte("weights"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Retry("b"); err != nil {
		t.Fatal(err)
	}
	e.waitReady("b", nil)
}
