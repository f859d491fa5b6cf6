package provision

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/infermesh/infermesh/internal/testproc"
	"github.com/infermesh/infermesh/placement"
)

// nativeMgr is one agent's worth of native provisioning: a native provider,
// a bbolt intent store, a real placement table and a running Manager.
type nativeMgr struct {
	t       *testing.T
	e       *nativeEnv
	p       *NativeProvider
	db      *bbolt.DB
	intents *BoltIntents
	table   *placement.Table
	m       *Manager

	mu     sync.Mutex
	events []Event

	cancel context.CancelFunc
	done   chan error
}

func newNativeMgr(t *testing.T, e *nativeEnv, dbPath string) *nativeMgr {
	t.Helper()
	nm := &nativeMgr{t: t, e: e, p: e.provider()}
	db, err := bbolt.Open(dbPath, 0o600, &bbolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	nm.db = db
	if nm.intents, err = NewBoltIntents(db, IntentsBucket); err != nil {
		t.Fatal(err)
	}
	if nm.table, err = placement.New(placement.Config{NodeID: "n1"}); err != nil {
		t.Fatal(err)
	}
	cfg := managerConfigForTest()
	cfg.Providers = map[string]InstanceProvider{RuntimeNative: nm.p}
	cfg.Intents, cfg.Registrar = nm.intents, nm.table
	cfg.Events = func(ev Event) {
		nm.mu.Lock()
		nm.events = append(nm.events, ev)
		nm.mu.Unlock()
	}
	if nm.m, err = NewManager(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	nm.cancel, nm.done = cancel, make(chan error, 1)
	go func() { nm.done <- nm.m.Run(ctx) }()
	t.Cleanup(nm.stop)
	return nm
}

// stop ends the manager (processes keep running), closes the provider and
// the store. Idempotent.
func (nm *nativeMgr) stop() {
	if nm.cancel == nil {
		return
	}
	nm.cancel()
	nm.cancel = nil
	if err := <-nm.done; err != nil {
		nm.t.Errorf("Run = %v", err)
	}
	nm.p.Close()
	nm.db.Close()
}

func (nm *nativeMgr) apply(desired map[string]InstanceSpec) {
	nm.t.Helper()
	if err := nm.m.Apply(context.Background(), desired); err != nil {
		nm.t.Fatal(err)
	}
}

func (nm *nativeMgr) waitState(role string, what string, pred func(InstanceStatus, bool) bool) InstanceStatus {
	nm.t.Helper()
	var st InstanceStatus
	testproc.WaitUntil(nm.t, role+" "+what, 60*time.Second, func() bool {
		var ok bool
		st, ok = nm.m.Instance(role)
		return pred(st, ok)
	})
	return st
}

func (nm *nativeMgr) hasEvent(kind EventKind, substr string) bool {
	nm.mu.Lock()
	defer nm.mu.Unlock()
	for _, e := range nm.events {
		if e.Kind == kind && strings.Contains(e.Message, substr) {
			return true
		}
	}
	return false
}

func nativeInstanceSpec(t *testing.T, port int, args ...string) InstanceSpec {
	return InstanceSpec{
		Runtime: RuntimeNative, Command: demoBinary(t),
		Args: append([]string{"-listen", "127.0.0.1:" + strconv.Itoa(port), "-model", "m-chat"}, args...),
		Port: port, Model: "m-chat",
		Restart: RestartPolicy{Max: 3, Window: time.Minute, Backoff: 50 * time.Millisecond},
	}
}

// TestManagerNativeRestartAndAdoption: a native instance that dies is
// restarted within its policy; a new manager (the agent restarted) adopts
// the running process instead of starting another.
func TestManagerNativeRestartAndAdoption(t *testing.T) {
	e := newNativeEnv(t)
	dbPath := filepath.Join(t.TempDir(), "state.db")
	port := testproc.FreePort(t)
	nm := newNativeMgr(t, e, dbPath)
	nm.apply(map[string]InstanceSpec{"chat": nativeInstanceSpec(t, port)})
	st := nm.waitState("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	if st.Runtime != RuntimeNative || st.PID == 0 || st.Endpoint != "127.0.0.1:"+strconv.Itoa(port) || st.Image != demoBinary(t) {
		t.Fatalf("ready instance = %+v", st)
	}
	if l, ok := nm.table.LocalBaseForRole("chat"); !ok || l != "http://127.0.0.1:"+strconv.Itoa(port)+"/v1" {
		t.Errorf("placement has %q, %v", l, ok)
	}
	if !nm.hasEvent(EventProvisionStart, fmt.Sprintf("started process %d", st.PID)) {
		t.Errorf("no provision_start event naming process %d", st.PID)
	}

	// Killed behind its back: restarted, a new process.
	first := st.PID
	syscall.Kill(first, syscall.SIGKILL)
	st = nm.waitState("chat", "restarted", func(s InstanceStatus, ok bool) bool {
		return ok && s.State == StateReady && s.PID != first && s.Restarts == 1
	})
	logs := nm.m.Logs("chat", 0)
	var sawKill, sawServing bool
	for _, l := range logs {
		sawKill = sawKill || strings.Contains(l.Line, "killed by signal 9")
		sawServing = sawServing || (l.Stream == "stderr" && strings.Contains(l.Line, "serving demo model"))
	}
	if !sawKill || !sawServing {
		t.Errorf("logs = %+v, want the kill and the server's own lines", logs)
	}

	// The agent restarts: the process runs on and is adopted, not
	// restarted.
	second := st.PID
	nm.stop()
	if !testproc.Alive(second) || !testproc.Healthy(port) {
		t.Fatal("the process did not outlive its manager")
	}
	nm2 := newNativeMgr(t, e, dbPath)
	nm2.apply(map[string]InstanceSpec{"chat": nativeInstanceSpec(t, port)})
	st = nm2.waitState("chat", "adopted", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	if st.PID != second || st.Restarts != 0 {
		t.Errorf("after the restart: pid %d restarts %d, want the same pid %d, not restarted", st.PID, st.Restarts, second)
	}
	if !nm2.hasEvent(EventProvisionStart, fmt.Sprintf("adopted running process %d", second)) {
		t.Errorf("no adoption event for pid %d", second)
	}
}

// TestManagerNativeGivesUp: an instance that exits at once is restarted up
// to its policy, then given up, its output kept for the operator.
func TestManagerNativeGivesUp(t *testing.T) {
	e := newNativeEnv(t)
	nm := newNativeMgr(t, e, filepath.Join(t.TempDir(), "state.db"))
	spec := nativeInstanceSpec(t, testproc.FreePort(t), "-no-such-flag")
	spec.Restart.Max = 2
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitState("chat", "failed", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateFailed })
	if st.Restarts != 2 || !strings.Contains(st.LastError, "gave up after 2 restarts") || !strings.Contains(st.LastError, "exited with status") {
		t.Errorf("failed instance = %+v", st)
	}
	testproc.WaitUntil(t, "a provision_failed event", 10*time.Second, func() bool { return nm.hasEvent(EventProvisionFailed, "gave up") })
	found := false
	for _, l := range nm.m.Logs("chat", 0) {
		found = found || (l.Stream == "stderr" && strings.Contains(l.Line, "flag provided but not defined"))
	}
	if !found {
		t.Errorf("logs = %+v, want the process's own error", nm.m.Logs("chat", 0))
	}
}

// TestManagerNativeRoleRemoved: removing a role stops its process and
// everything in its group, and forgets its record and intent.
func TestManagerNativeRoleRemoved(t *testing.T) {
	e := newNativeEnv(t)
	nm := newNativeMgr(t, e, filepath.Join(t.TempDir(), "state.db"))
	port := testproc.FreePort(t)
	spec := nativeInstanceSpec(t, port)
	spec.Command = "/bin/sh"
	spec.Args = []string{"-c", fmt.Sprintf("sleep 1000 & exec %s -listen 127.0.0.1:%d -model m-chat", demoBinary(t), port)}
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitState("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	pgid := st.PID
	if !groupAlive(pgid) {
		t.Fatal("no process group")
	}
	nm.apply(map[string]InstanceSpec{})
	nm.waitState("chat", "removed", func(_ InstanceStatus, ok bool) bool { return !ok })
	if groupAlive(pgid) {
		t.Errorf("process group %d has live members after the role was removed", pgid)
	}
	if refs, _ := nm.p.ListManagedRefs(context.Background()); len(refs) != 0 {
		t.Errorf("records left: %v", refs)
	}
	if in, _ := nm.intents.Intents(); len(in) != 0 {
		t.Errorf("intents left: %v", in)
	}
}
