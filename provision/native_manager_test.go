package provision

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// nativeMgr is a Manager of native instances.
type nativeMgr struct {
	*mgrRun
	e *nativeEnv
	p *NativeProvider
}

func newNativeMgr(t *testing.T, e *nativeEnv, dbPath string) *nativeMgr {
	t.Helper()
	p := e.provider()
	return &nativeMgr{mgrRun: startManager(t, dbPath, map[string]InstanceProvider{RuntimeNative: p}, func() { p.Close() }), e: e, p: p}
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
	port := testnet.TCPPort(t, "127.0.0.1")
	nm := newNativeMgr(t, e, dbPath)
	nm.apply(map[string]InstanceSpec{"chat": nativeInstanceSpec(t, port)})
	st := nm.waitInstance("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
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
	st = nm.waitInstance("chat", "restarted", func(s InstanceStatus, ok bool) bool {
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
	st = nm2.waitInstance("chat", "adopted", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
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
	spec := nativeInstanceSpec(t, testnet.TCPPort(t, "127.0.0.1"), "-no-such-flag")
	spec.Restart.Max = 2
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitInstance("chat", "failed", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateFailed })
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
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeInstanceSpec(t, port)
	spec.Command = "/bin/sh"
	spec.Args = []string{"-c", fmt.Sprintf("sleep 1000 & exec %s -listen 127.0.0.1:%d -model m-chat", demoBinary(t), port)}
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitInstance("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	pgid := st.PID
	if !groupAlive(pgid) {
		t.Fatal("no process group")
	}
	nm.apply(map[string]InstanceSpec{})
	nm.waitInstance("chat", "removed", func(_ InstanceStatus, ok bool) bool { return !ok })
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

// TestManagerStartTimeoutPerInstance: an instance that never answers its
// health path is restarted after its own start-up timeout, not the
// manager's ReadyTimeout (20s here).
func TestManagerStartTimeoutPerInstance(t *testing.T) {
	e := newNativeEnv(t)
	nm := newNativeMgr(t, e, filepath.Join(t.TempDir(), "state.db"))
	spec := nativeInstanceSpec(t, testnet.TCPPort(t, "127.0.0.1"))
	spec.Health = "/no-such-path" // the demo answers 404: never ready
	spec.StartTimeout = time.Second
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitInstance("chat", "restarted for its start-up timeout", func(s InstanceStatus, ok bool) bool {
		return ok && s.Restarts >= 1
	})
	if !nm.hasEvent(EventInstanceStopped, "no answer on /no-such-path for 1s") && !strings.Contains(st.LastError, "for 1s") {
		t.Errorf("instance = %+v; want it restarted for no answer within its 1s start-up timeout", st)
	}
	if err := nm.m.Apply(context.Background(), map[string]InstanceSpec{"chat": {Runtime: RuntimeNative, Command: spec.Command, Port: spec.Port, StartTimeout: -time.Second}}); err == nil {
		t.Error("Apply took a negative start timeout")
	}
}

// TestManagerStopAndHalt: the operator's Stop stops the instance and keeps
// it stopped (a reconcile does not bring it back) until Retry; Halt after
// the manager ended stops what is left, as an agent configured to stop its
// instances with it does at shutdown.
func TestManagerStopAndHalt(t *testing.T) {
	e := newNativeEnv(t)
	nm := newNativeMgr(t, e, filepath.Join(t.TempDir(), "state.db"))
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeInstanceSpec(t, port)
	nm.apply(map[string]InstanceSpec{"chat": spec})
	st := nm.waitInstance("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	pid := st.PID

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := nm.m.Stop(ctx, "chat"); err != nil {
		t.Fatal(err)
	}
	if testproc.Alive(pid) {
		t.Errorf("process %d runs after Stop", pid)
	}
	st, _ = nm.m.Instance("chat")
	if st.State != StateStopped || st.LastError != StoppedByOperator {
		t.Errorf("after Stop = %+v, want stopped, by the operator", st)
	}
	if _, ok := nm.table.LocalBaseForRole("chat"); ok {
		t.Error("a stopped instance is still in placement")
	}
	// The same desired set again: it stays stopped.
	nm.apply(map[string]InstanceSpec{"chat": spec})
	if st, _ = nm.m.Instance("chat"); st.State != StateStopped {
		t.Errorf("after a reconcile = %+v, want it still stopped", st)
	}
	if err := nm.m.Stop(ctx, "nope"); err == nil {
		t.Error("Stop of a role without an instance succeeded")
	}

	if err := nm.m.Retry("chat"); err != nil {
		t.Fatal(err)
	}
	st = nm.waitInstance("chat", "ready again", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady && s.PID != pid })
	again := st.PID
	nm.stopThen(func() {
		if !testproc.Alive(again) {
			t.Fatalf("process %d did not outlive its manager", again)
		}
		if err := nm.m.Halt(ctx, "chat"); err != nil {
			t.Fatal(err)
		}
		if testproc.Alive(again) {
			t.Errorf("process %d runs after Halt", again)
		}
		if intents, err := nm.intents.Intents(); err != nil || len(intents) != 0 {
			t.Errorf("intents after Halt = %v, %v; want none", intents, err)
		}
	})
}
