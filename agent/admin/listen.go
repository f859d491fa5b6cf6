package admin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/infermesh/infermesh/internal/defaults"
)

// Socket and directory modes.
const (
	DefaultSocketMode fs.FileMode = 0o660
	DefaultDirMode    fs.FileMode = 0o750
)

// ListenConfig says where and how to create the admin socket. Zero values
// mean the defaults.
type ListenConfig struct {
	// Path of the socket. Required.
	Path string
	// Group owns the socket (and its directory, see Listen) when set: a
	// group name or numeric id.
	Group string
	// SocketMode of the socket file. Default DefaultSocketMode (0660): the
	// agent's user and the group may connect. The server checks every
	// connection's credentials, so a wider mode only lets more users read.
	SocketMode fs.FileMode
	// DirMode of the socket's directory when Listen creates or adjusts it.
	// Default DefaultDirMode (0750).
	DirMode fs.FileMode
	// ProbeTimeout bounds the check for a live agent on an existing socket.
	// Default 1s.
	ProbeTimeout time.Duration
}

// LookupGroup resolves a group name or numeric id to a gid.
func LookupGroup(group string) (int, error) {
	if n, err := strconv.Atoi(group); err == nil && n >= 0 {
		return n, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, fmt.Errorf("group %q: %w", group, err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("group %q: gid %q: %w", group, g.Gid, err)
	}
	return gid, nil
}

// Listen claims the admin socket at c.Path and listens on it.
//
// An existing socket that a live process answers on is left alone and
// Listen returns an error wrapping ErrInUse: a second agent refuses to
// start. A stale one (nothing answers) is removed. A path that exists and is
// not a socket is an error: Listen never removes other files.
//
// The directory is created with DirMode (and the group) when missing; an
// existing directory is adjusted to DirMode and the group only when a group
// is configured and the directory belongs to this user and is not writable
// by others (so /tmp is never touched). The socket gets SocketMode and the
// group. Closing the listener removes the socket file.
func Listen(c ListenConfig) (*net.UnixListener, error) {
	if c.Path == "" {
		return nil, errors.New("admin socket: no path")
	}
	if c.SocketMode == 0 {
		c.SocketMode = DefaultSocketMode
	}
	if c.DirMode == 0 {
		c.DirMode = DefaultDirMode
	}
	defaults.Positive(&c.ProbeTimeout, time.Second)
	gid := -1
	if c.Group != "" {
		g, err := LookupGroup(c.Group)
		if err != nil {
			return nil, fmt.Errorf("admin socket: %w", err)
		}
		gid = g
	}
	if err := prepareDir(filepath.Dir(c.Path), c.DirMode, gid); err != nil {
		return nil, fmt.Errorf("admin socket %s: %w%s", c.Path, err, memberHint(err, c.Group))
	}
	if err := clearStale(c.Path, c.ProbeTimeout); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: c.Path, Net: "unix"})
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			// Another agent won the race to bind since we checked.
			return nil, fmt.Errorf("admin socket %s: %w", c.Path, ErrInUse)
		}
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if gid >= 0 {
		if err := os.Lchown(c.Path, -1, gid); err != nil {
			_ = ln.Close()
			return nil, fmt.Errorf("admin socket %s: chown to group %s: %w%s", c.Path, c.Group, err, memberHint(err, c.Group))
		}
	}
	if err := os.Chmod(c.Path, c.SocketMode); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("admin socket %s: %w", c.Path, err)
	}
	return ln, nil
}

// memberHint says what a refused chown to the admin group needs: a process
// that is not root may give its files only to groups it is a member of.
func memberHint(err error, group string) string {
	if group == "" || !errors.Is(err, fs.ErrPermission) {
		return ""
	}
	name := strconv.Itoa(os.Geteuid())
	if u, uerr := user.LookupId(name); uerr == nil {
		name = u.Username
	}
	return fmt.Sprintf(" (the agent runs as %s, which must be a member of admin.group %s: usermod -aG %s %s, then restart the agent)", name, group, group, name)
}

func prepareDir(dir string, mode fs.FileMode, gid int) error {
	st, err := os.Stat(dir)
	created := false
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, mode); err != nil {
			return err
		}
		created = true
		st, err = os.Stat(dir)
	}
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	mine := ok && int(sys.Uid) == os.Geteuid()
	shared := st.Mode().Perm()&0o002 != 0 || st.Mode()&fs.ModeSticky != 0
	if !created && (gid < 0 || !mine || shared) {
		return nil
	}
	if gid >= 0 {
		if err := os.Chown(dir, -1, gid); err != nil {
			return fmt.Errorf("chown %s to gid %d: %w", dir, gid, err)
		}
	}
	return os.Chmod(dir, mode) // MkdirAll's mode is masked by the umask
}

// clearStale removes path when it is a socket nobody answers on.
func clearStale(path string, timeout time.Duration) error {
	st, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("admin socket: %w", err)
	}
	if st.Mode()&fs.ModeSocket == 0 {
		return fmt.Errorf("admin socket %s: exists and is not a socket; not removing it", path)
	}
	conn, err := net.DialTimeout("unix", path, timeout)
	if err == nil {
		_ = conn.Close()
		return fmt.Errorf("admin socket %s: %w (is infermeshd already running?)", path, ErrInUse)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, fs.ErrNotExist) {
		// EACCES, a timeout (a live but stuck agent): do not guess.
		return fmt.Errorf("admin socket %s: cannot tell whether an agent is listening: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("admin socket %s: remove stale socket: %w", path, err)
	}
	return nil
}

// peerCred reads the kernel's credentials of a Unix socket's peer.
func peerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("not a unix connection: %T", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, credErr
}

type callerKey struct{}

// callerFrom returns the connection's caller; ok is false when the kernel
// did not tell (the request is then refused).
func callerFrom(ctx context.Context) (Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(Caller)
	return c, ok
}

// inGroup reports whether the process pid (running as uid) is in group
// gid: its supplementary groups from /proc (what the process really holds),
// else the user database.
func inGroup(pid int32, uid uint32, gid int) bool {
	if data, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/status"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			rest, ok := strings.CutPrefix(line, "Groups:")
			if !ok {
				continue
			}
			for _, f := range strings.Fields(rest) {
				if n, err := strconv.Atoi(f); err == nil && n == gid {
					return true
				}
			}
			return false
		}
	}
	u, err := user.LookupId(strconv.Itoa(int(uid)))
	if err != nil {
		return false
	}
	ids, err := u.GroupIds()
	if err != nil {
		return false
	}
	want := strconv.Itoa(gid)
	for _, id := range ids {
		if id == want {
			return true
		}
	}
	return false
}

func userName(uid uint32) string {
	u, err := user.LookupId(strconv.Itoa(int(uid)))
	if err != nil {
		return ""
	}
	return u.Username
}
