package provision

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// What the native runtime reads from /proc to know a process, and how it
// signals one. A pid alone is never trusted: pids are reused. A process is
// identified by its pid together with its start time (field 22 of
// /proc/<pid>/stat, in clock ticks since boot, unique per pid within one
// boot) and the boot it belongs to; signals go through a pidfd opened while
// the identity held, so they cannot reach a later process with the same pid.

// errNoProcess: no live process has the pid (gone, or a zombie: it has
// exited and only waits to be reaped).
var errNoProcess = errors.New("no such process")

// procStat is the part of /proc/<pid>/stat the runtime uses.
type procStat struct {
	Pid       int
	State     byte // R, S, D, Z, T, ...
	PPid      int
	Pgrp      int
	Session   int
	StartTime uint64
}

// readProcStat reads /proc/<pid>/stat. A missing or zombie process is
// errNoProcess.
func readProcStat(pid int) (procStat, error) {
	if pid <= 0 {
		return procStat{}, errNoProcess
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
			return procStat{}, errNoProcess
		}
		return procStat{}, err
	}
	st, err := parseProcStat(b)
	if err != nil {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	if st.State == 'Z' || st.State == 'X' {
		return st, errNoProcess
	}
	return st, nil
}

// parseProcStat parses one /proc/<pid>/stat line. The command name (field
// 2) is in parentheses and may itself hold spaces and parentheses, so the
// fields after it are found from the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	open := bytes.IndexByte(b, '(')
	end := bytes.LastIndexByte(b, ')')
	if open < 1 || end < open {
		return procStat{}, errors.New("malformed")
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b[:open])))
	if err != nil {
		return procStat{}, fmt.Errorf("pid: %w", err)
	}
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state); field n is f[n-3].
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, errors.New("too few fields")
	}
	st := procStat{Pid: pid, State: f[0][0]}
	ints := []*int{&st.PPid, &st.Pgrp, &st.Session}
	for i, p := range ints {
		if *p, err = strconv.Atoi(f[1+i]); err != nil {
			return procStat{}, fmt.Errorf("field %d: %w", 4+i, err)
		}
	}
	if st.StartTime, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return procStat{}, fmt.Errorf("starttime: %w", err)
	}
	return st, nil
}

// procExe is the executable of pid (/proc/<pid>/exe). An executable
// replaced on disk since the process started (a package upgrade) reads
// "<path> (deleted)"; the path is what it ran.
func procExe(pid int) (string, error) {
	exe, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/exe")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", errNoProcess
		}
		if errors.Is(err, os.ErrPermission) {
			// Another user's process: one an agent running as root
			// started, say, before the agent ran as its own user.
			if st, serr := os.Stat("/proc/" + strconv.Itoa(pid)); serr == nil {
				if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
					return "", fmt.Errorf("%w: the process runs as uid %d, this agent as uid %d; stop it as uid %d (with the agent stopped, `infermesh site cleanup --targets <node>` as root)",
						err, sys.Uid, os.Geteuid(), sys.Uid)
				}
			}
		}
		return "", err
	}
	return strings.TrimSuffix(exe, " (deleted)"), nil
}

// procEnvHas reports whether the initial environment of pid holds kv
// ("NAME=value").
func procEnvHas(pid int, kv string) (bool, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, errNoProcess
		}
		return false, err
	}
	for _, e := range bytes.Split(b, []byte{0}) {
		if string(e) == kv {
			return true, nil
		}
	}
	return false, nil
}

// bootID identifies this boot of the host: a record from another boot names
// a process that cannot exist any more.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// listPids lists the pids in /proc.
func listPids() ([]int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	pids := make([]int, 0, len(ents))
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// findByEnv returns the live process whose initial environment holds kv and
// that leads its own session, or 0 when there is none. It is how a process
// started just before its record could be completed is found again: kv
// holds a token that was made and recorded before the process started.
func findByEnv(kv string) (int, error) {
	pids, err := listPids()
	if err != nil {
		return 0, err
	}
	for _, pid := range pids {
		st, err := readProcStat(pid)
		if err != nil || st.Session != pid {
			continue
		}
		if ok, err := procEnvHas(pid, kv); err == nil && ok {
			return pid, nil
		}
	}
	return 0, nil
}

// groupAlive reports whether any live (not zombie) process is in process
// group pgid.
func groupAlive(pgid int) bool {
	pids, err := listPids()
	if err != nil {
		return true // cannot tell: assume so, and keep waiting or fail
	}
	for _, pid := range pids {
		if st, err := readProcStat(pid); err == nil && st.Pgrp == pgid {
			return true
		}
	}
	return false
}

// pidfd is an open pidfd of one process: it stays bound to that process
// even after its pid is reused. Safe for concurrent use; once closed it
// reports the process as exited and signals nothing (a closed descriptor's
// number may be reused by another file, so it is never used again).
type pidfd struct {
	mu  sync.Mutex
	fd  int // -1 once closed
	pid int
}

// openPidfd opens a pidfd for pid and checks, after opening, that the
// process still has startTime: then the pidfd is bound to the process the
// start time names.
func openPidfd(pid int, startTime uint64) (*pidfd, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, errNoProcess
		}
		return nil, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	st, err := readProcStat(pid)
	if err == nil && st.StartTime != startTime {
		err = errNoProcess // the one we meant is gone; pid reused
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &pidfd{fd: fd, pid: pid}, nil
}

func (p *pidfd) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd >= 0 {
		unix.Close(p.fd)
		p.fd = -1
	}
}

// signal sends sig to the process.
func (p *pidfd) signal(sig unix.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd < 0 {
		return nil
	}
	err := unix.PidfdSendSignal(p.fd, sig, nil, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil // already exited
	}
	return err
}

// exited waits up to d for the process to exit and reports whether it did.
func (p *pidfd) exited(d time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd < 0 {
		return true
	}
	ms := int(d / time.Millisecond)
	if d > 0 && ms == 0 {
		ms = 1
	}
	fds := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n > 0
	}
}

// stopGroup stops the process behind p and everything in its process group
// (the native runtime starts every instance as the leader of its own
// session and group): SIGTERM, then after grace SIGKILL, and waits until
// no live member is left. The group id is the leader's pid, which the
// kernel does not hand to a new process while the group has members, so
// signalling the group cannot reach another process.
func stopGroup(ctx context.Context, p *pidfd, grace time.Duration) error {
	pgid := p.pid
	gone := func() bool { return p.exited(0) && !groupAlive(pgid) }
	wait := func(d time.Duration) bool {
		deadline := time.Now().Add(d)
		for {
			if gone() {
				return true
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return false
			}
			p.exited(25 * time.Millisecond)
			if p.exited(0) {
				time.Sleep(10 * time.Millisecond) // the leader is gone; members may linger briefly
			}
		}
	}
	send := func(sig unix.Signal) error {
		if err := p.signal(sig); err != nil {
			return fmt.Errorf("signal %v to pid %d: %w", sig, p.pid, err)
		}
		if err := unix.Kill(-pgid, sig); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("signal %v to process group %d: %w", sig, pgid, err)
		}
		return nil
	}
	if gone() {
		return nil
	}
	if err := send(unix.SIGTERM); err != nil {
		return err
	}
	if wait(grace) {
		return nil
	}
	if err := send(unix.SIGKILL); err != nil {
		return err
	}
	if wait(10 * time.Second) {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return fmt.Errorf("process group %d still has live members after SIGKILL", pgid)
}
