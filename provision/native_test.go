package provision

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// nativeEnv is one node's native runtime in temporary directories.
type nativeEnv struct {
	t     *testing.T
	site  string
	node  string
	dir   string // node folder
	cache string
	root  string // site root
}

func newNativeEnv(t *testing.T) *nativeEnv {
	t.Helper()
	site := fmt.Sprintf("nt%s-%d", runID, siteSeq.Add(1))
	l := cleanup.Layout{StateDir: t.TempDir(), CacheRoot: t.TempDir(), Site: site}
	e := &nativeEnv{t: t, site: site, node: "n1", root: l.SiteRoot(), dir: l.NodeDir("n1"), cache: l.NodeCache("n1")}
	t.Cleanup(e.killAll)
	return e
}

func (e *nativeEnv) provider() *NativeProvider {
	e.t.Helper()
	p, err := NewNativeProvider(NativeConfig{
		Site: e.site, Node: e.node, Dir: e.dir, CacheDir: e.cache,
		StopTimeout: 2 * time.Second, PollInterval: 20 * time.Millisecond,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { p.Close() })
	return p
}

// killAll kills whatever process a record of the site still names, so a
// failed test leaves nothing running.
func (e *nativeEnv) killAll() {
	recs, _ := findRecords(e.root, false)
	for _, r := range recs {
		if ev, err := r.Rec.Check(); err == nil && ev.Liveness == Alive {
			syscall.Kill(-ev.Pid, syscall.SIGKILL)
		}
	}
}

// nativeSpec serves the demo model as a native process on port.
func nativeSpec(t *testing.T, role string, attempt uint64, port int) ProvisionSpec {
	return ProvisionSpec{
		InstanceID: 7, AttemptID: attempt, Role: role, Runtime: RuntimeNative,
		Command: demoBinary(t),
		Args:    []string{"-listen", "127.0.0.1:" + strconv.Itoa(port), "-model", "demo-" + role},
		Env:     []EnvVar{{Name: "INFERMESH_TEST", Value: "1"}},
		Ports:   []int{port},
	}
}

func TestNativeLifecycle(t *testing.T) {
	e := newNativeEnv(t)
	p := e.provider()
	ctx := context.Background()
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeSpec(t, "chat", 1, port)
	rec := newRecorder()

	h, err := p.CreateInstance(ctx, spec, rec)
	if err != nil {
		t.Fatal(err)
	}
	if h.Ref != "infermesh-"+e.site+"-n1-chat-1" {
		t.Errorf("ref = %s", h.Ref)
	}
	r, err := readRecord(recordPath(e.dir, h.Ref))
	if err != nil || r.State != WorkloadCreated || r.Pid != 0 {
		t.Fatalf("record after create = %+v, %v; want state created without a pid", r, err)
	}
	if err := p.StartInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	testproc.WaitUntil(t, "the process to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })

	// The record is the process's evidence, and every part of it holds.
	r, err = readRecord(recordPath(e.dir, h.Ref))
	if err != nil {
		t.Fatal(err)
	}
	st, err := readProcStat(r.Pid)
	if err != nil {
		t.Fatalf("recorded pid %d: %v", r.Pid, err)
	}
	if r.State != WorkloadRunning || r.Site != e.site || r.Node != "n1" || r.Target != "n1" || r.Role != "chat" || r.Attempt != 1 {
		t.Errorf("record = %+v", r)
	}
	if r.StartTime != st.StartTime || r.Executable != demoBinary(t) || r.BootID == "" {
		t.Errorf("record start %d exe %s boot %q; /proc says start %d", r.StartTime, r.Executable, r.BootID, st.StartTime)
	}
	if st.Session != r.Pid || st.Pgrp != r.Pid {
		t.Errorf("pid %d: session %d, group %d; want its own session and group", r.Pid, st.Session, st.Pgrp)
	}
	if ok, _ := procEnvHas(r.Pid, TokenEnv+"="+r.Token); !ok {
		t.Errorf("the process does not carry its token")
	}
	if ev, err := r.Check(); err != nil || ev.Liveness != Alive || ev.Pid != r.Pid {
		t.Errorf("Check = %+v, %v; want alive", ev, err)
	}
	if cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", r.Pid)); cwd != filepath.Join(e.cache, "chat") {
		t.Errorf("working directory %s, want the instance's cache %s", cwd, filepath.Join(e.cache, "chat"))
	}
	rs, err := p.Status(ctx, h.Ref)
	if err != nil || !rs.Running || rs.Pid != r.Pid || rs.Endpoints[port] != "127.0.0.1:"+strconv.Itoa(port) {
		t.Errorf("Status = %+v, %v", rs, err)
	}
	// Its output is observed from its log files.
	rec.waitFor(t, 10*time.Second, func(o Observation) bool {
		return o.Kind == ObsStderr && strings.Contains(o.Line, "serving demo model")
	})

	// Halt stops it and keeps the record; Start runs a new process.
	first := r.Pid
	if err := p.HaltInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	if testproc.Alive(first) {
		t.Fatalf("pid %d alive after HaltInstance", first)
	}
	end, _ := rec.waitFor(t, 10*time.Second, func(o Observation) bool { return o.Kind == ObsExited || o.Kind == ObsFailed })
	if end.Kind != ObsExited || end.Status == nil || *end.Status != 0 {
		t.Errorf("end of a halted run = %+v, want exited with status 0 (SIGTERM: a clean shutdown)", end)
	}
	if r, _ := readRecord(recordPath(e.dir, h.Ref)); r.State != WorkloadExited || r.ExitStatus == nil {
		t.Errorf("record after halt = %+v, want exited with a status", r)
	}
	if err := p.StartInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	testproc.WaitUntil(t, "the restarted process to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })
	r, _ = readRecord(recordPath(e.dir, h.Ref))
	if r.Pid == first || !testproc.Alive(r.Pid) {
		t.Errorf("restarted pid %d (first %d)", r.Pid, first)
	}

	// Stop removes the process, its record and its logs.
	if err := p.StopInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	if testproc.Alive(r.Pid) {
		t.Errorf("pid %d alive after StopInstance", r.Pid)
	}
	out, errp := logPaths(e.dir, h.Ref)
	for _, f := range []string{recordPath(e.dir, h.Ref), out, errp} {
		if _, err := os.Stat(f); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s left after StopInstance: %v", f, err)
		}
	}
	if _, err := p.Status(ctx, h.Ref); !errors.Is(err, ErrNotFound) {
		t.Errorf("Status after stop = %v, want ErrNotFound", err)
	}
	if found, err := p.StopBySpec(ctx, spec, nil); found || err != nil {
		t.Errorf("StopBySpec of a stopped instance = %v, %v; want false, nil", found, err)
	}
}

// TestNativeAdoption: a process outlives its provider (the agent), and the
// next provider adopts it: same pid, not restarted, its logs replayed.
func TestNativeAdoption(t *testing.T) {
	e := newNativeEnv(t)
	ctx := context.Background()
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeSpec(t, "chat", 1, port)

	p1 := e.provider()
	h, err := p1.CreateInstance(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p1.StartInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	testproc.WaitUntil(t, "the process to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })
	r, _ := readRecord(recordPath(e.dir, h.Ref))
	p1.Close()
	if !testproc.Alive(r.Pid) || !testproc.Healthy(port) {
		t.Fatalf("the process did not outlive its provider")
	}

	p2 := e.provider()
	rec := newRecorder()
	// A spec of another content is not this process.
	other := spec.Clone()
	other.Args = append(other.Args, "-tokens", "3")
	if _, ok, err := p2.AdoptBySpec(ctx, other, rec); ok || err != nil {
		t.Errorf("AdoptBySpec(changed spec) = %v, %v; want false", ok, err)
	}
	a, ok, err := p2.AdoptBySpec(ctx, spec, rec)
	if err != nil || !ok || !a.Running || int(a.Handle.ProcessID) != r.Pid {
		t.Fatalf("AdoptBySpec = %+v, %v, %v; want pid %d running", a, ok, err, r.Pid)
	}
	rec.waitFor(t, 10*time.Second, func(o Observation) bool {
		return o.Kind == ObsStderr && strings.Contains(o.Line, "serving demo model")
	})
	// Adopted within the process that started it, it is still this
	// process's child: reaped, its end known. (An agent restarted for real
	// is another process; see the agent's kill -9 test.)
	syscall.Kill(r.Pid, syscall.SIGKILL)
	end, _ := rec.waitFor(t, 10*time.Second, func(o Observation) bool { return o.Kind == ObsExited || o.Kind == ObsFailed })
	if end.Kind != ObsFailed || !strings.Contains(end.Reason, "killed by signal 9") {
		t.Errorf("end of an adopted process = %+v, want failed: killed by signal 9", end)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", r.Pid)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("pid %d left as a zombie: %v", r.Pid, err)
	}
	if a, ok, err := p2.AdoptBySpec(ctx, spec, nil); ok || err != nil {
		t.Errorf("AdoptBySpec after the process died = %+v, %v, %v; want nothing to adopt", a, ok, err)
	}
	if a, ok, err := p2.PrepareBySpec(ctx, spec, nil); !ok || err != nil || a.Running {
		t.Errorf("PrepareBySpec after the process died = %+v, %v, %v; want its record, not running", a, ok, err)
	}
}

// TestNativeFindsAProcessItsRecordMissed: the agent died after starting
// the process and before completing its record. The token it recorded
// first finds the process again: adopted, not started twice.
func TestNativeFindsAProcessItsRecordMissed(t *testing.T) {
	e := newNativeEnv(t)
	ctx := context.Background()
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeSpec(t, "chat", 1, port)
	p := e.provider()
	h, err := p.CreateInstance(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	path := recordPath(e.dir, h.Ref)
	r, _ := readRecord(path)
	r.Token = newToken()
	if err := writeRecord(path, r); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(spec.Command, spec.Args...)
	cmd.Env = []string{TokenEnv + "=" + r.Token}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	testproc.WaitUntil(t, "the process to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })

	a, ok, err := e.provider().AdoptBySpec(ctx, spec, nil)
	if err != nil || !ok || int(a.Handle.ProcessID) != cmd.Process.Pid {
		t.Fatalf("AdoptBySpec = %+v, %v, %v; want pid %d", a, ok, err, cmd.Process.Pid)
	}
	r, _ = readRecord(path)
	if r.State != WorkloadRunning || r.Pid != cmd.Process.Pid || r.Executable != spec.Command {
		t.Errorf("record after adoption = %+v, want it completed", r)
	}
}

// TestNativeStopKillsTheGroup: stopping an instance stops everything it
// started in its process group, so nothing is left behind.
func TestNativeStopKillsTheGroup(t *testing.T) {
	e := newNativeEnv(t)
	ctx := context.Background()
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeSpec(t, "chat", 1, port)
	// A wrapper that leaves a child behind and execs the server.
	spec.Command = "/bin/sh"
	spec.Args = []string{"-c", fmt.Sprintf("sleep 1000 & exec %s -listen 127.0.0.1:%d", demoBinary(t), port)}
	p := e.provider()
	h, err := p.CreateInstance(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.StartInstance(ctx, h); err != nil {
		t.Fatal(err)
	}
	testproc.WaitUntil(t, "the process to answer", 20*time.Second, func() bool { return testproc.Healthy(port) })
	r, _ := readRecord(recordPath(e.dir, h.Ref))
	if err := p.MarkLive(ctx, h); err != nil {
		t.Fatal(err)
	}
	// The wrapper exec'd the server: the record follows the executable.
	if r2, _ := readRecord(recordPath(e.dir, h.Ref)); r2.Executable != demoBinary(t) {
		t.Errorf("record executable after MarkLive = %s, want %s", r2.Executable, demoBinary(t))
	}
	if !groupAlive(r.Pid) {
		t.Fatal("no process in the instance's group")
	}
	members := 0
	pids, _ := listPids()
	for _, pid := range pids {
		if st, err := readProcStat(pid); err == nil && st.Pgrp == r.Pid {
			members++
		}
	}
	if members < 2 {
		t.Fatalf("the group has %d live members, want the server and its sleep", members)
	}
	if found, err := p.StopBySpec(ctx, spec, nil); !found || err != nil {
		t.Fatalf("StopBySpec = %v, %v", found, err)
	}
	if groupAlive(r.Pid) {
		t.Errorf("process group %d has live members after StopBySpec", r.Pid)
	}
}

// TestNativeEvidence: a record is trusted only while everything in it holds
// of the live process.
func TestNativeEvidence(t *testing.T) {
	// An unrelated process: the same user, its own session, not ours.
	sleep := exec.Command("/bin/sleep", "1000")
	sleep.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleep.Process.Kill(); sleep.Wait() })
	pid := sleep.Process.Pid
	st, err := readProcStat(pid)
	if err != nil {
		t.Fatal(err)
	}
	exe, _ := procExe(pid)
	boot, _ := bootID()
	// A process that has exited (reaped).
	gone := exec.Command("/bin/true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	running := WorkloadRecord{State: WorkloadRunning, Pid: pid, StartTime: st.StartTime, Executable: exe, BootID: boot, Token: newToken(), Command: "/bin/sleep"}
	with := func(f func(*WorkloadRecord)) WorkloadRecord { r := running; f(&r); return r }
	for _, tt := range []struct {
		name string
		rec  WorkloadRecord
		want Liveness
		why  string
	}{
		{"live pid of an unrelated process", running, Forged, "does not carry the workload's token"},
		{"reused pid with another start time", with(func(r *WorkloadRecord) { r.StartTime-- }), Reused, "is another process now"},
		{"another executable", with(func(r *WorkloadRecord) { r.Executable = "/usr/bin/llama-server" }), Forged, "runs"},
		{"exited process", with(func(r *WorkloadRecord) { r.Pid = gone.Process.Pid }), Gone, ""},
		{"another boot", with(func(r *WorkloadRecord) { r.BootID = "00000000-0000-0000-0000-000000000000" }), Gone, "earlier boot"},
		{"running without a token", with(func(r *WorkloadRecord) { r.Token = "" }), Forged, "without"},
		{"never started", WorkloadRecord{State: WorkloadCreated}, Gone, "never started"},
		{"created, its token on no process", WorkloadRecord{State: WorkloadCreated, Token: newToken(), Command: "/bin/sleep"}, Gone, "never started"},
		{"exited record", with(func(r *WorkloadRecord) { r.State = WorkloadExited }), Gone, "exited"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ev, err := tt.rec.Check()
			if err != nil {
				t.Fatal(err)
			}
			if ev.Liveness != tt.want || !strings.Contains(ev.Why, tt.why) {
				t.Errorf("Check = %+v, want liveness %d saying %q", ev, tt.want, tt.why)
			}
		})
	}
	if _, err := (WorkloadRecord{State: "paused"}).Check(); err == nil {
		t.Errorf("Check of an unknown state = nil error")
	}
	if !testproc.Alive(pid) {
		t.Fatal("checking evidence touched the unrelated process")
	}
}

func TestParseProcStat(t *testing.T) {
	for _, tt := range []struct {
		line string
		want procStat
		err  bool
	}{
		{"42 (demo) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 9876 0 0", procStat{Pid: 42, State: 'S', PPid: 1, Pgrp: 42, Session: 42, StartTime: 9876}, false},
		{"7 (a (b) c) Z 2 3 4 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0", procStat{Pid: 7, State: 'Z', PPid: 2, Pgrp: 3, Session: 4, StartTime: 55}, false},
		{"7 (x) S 1 2", procStat{}, true},
		{"garbage", procStat{}, true},
	} {
		got, err := parseProcStat([]byte(tt.line))
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("parseProcStat(%q) = %+v, %v; want %+v, err %v", tt.line, got, err, tt.want, tt.err)
		}
	}
}

func TestTailOffset(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	os.WriteFile(path, []byte("a\nbb\nccc\n"), 0o600)
	for n, want := range map[int]int64{1: 5, 2: 2, 3: 0, 10: 0, 0: 9} {
		if got := tailOffset(path, n); got != want {
			t.Errorf("tailOffset(%d) = %d, want %d", n, got, want)
		}
	}
	os.WriteFile(path, []byte("a\nbb\ncc"), 0o600) // the last line is not finished
	if got := tailOffset(path, 1); got != 5 {
		t.Errorf("tailOffset(1) of an unfinished line = %d, want 5", got)
	}
}
