package admin

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// SocketRefusedError is a connect to the admin socket that the kernel
// refused this process: the socket's mode, or a directory's on the way to
// it, lets only its owner and group in, and this process is neither. It
// matches ErrForbidden: the agent was never asked.
type SocketRefusedError struct {
	// Path is the socket.
	Path string
	// Denied is what refused: the socket itself or the directory on its
	// path this process may not enter.
	Denied string
	Mode   fs.FileMode
	// Owner and Group of Denied: names, or numbers where the user and
	// group databases do not say.
	Owner, Group string
	GID          int
	// User is this process's user; Listed says the group database lists
	// it in Group although this process does not hold the group (added
	// to it after logging in).
	User   string
	Listed bool
	// HeldGroup: this process holds the group and is still refused (a
	// mode that shuts the group out too).
	HeldGroup bool
	Err       error
}

func (e *SocketRefusedError) Error() string {
	what := fmt.Sprintf("%s (%s %s:%s)", e.Denied, e.Mode, e.Owner, e.Group)
	switch {
	case e.HeldGroup:
		return fmt.Sprintf("permission denied: %s lets in only its owner %s", what, e.Owner)
	case e.Listed:
		return fmt.Sprintf("permission denied: you are in group %s, but this login is not yet: log in again (or run newgrp %s), then retry; it owns %s",
			e.Group, e.Group, what)
	}
	return fmt.Sprintf("permission denied: you are not in group %s, which owns %s; an administrator adds you with: usermod -aG %s %s (then log in again)",
		e.Group, what, e.Group, e.User)
}

// Is matches ErrForbidden.
func (e *SocketRefusedError) Is(target error) bool { return target == ErrForbidden }

func (e *SocketRefusedError) Unwrap() error { return e.Err }

// refused explains a connect to path that failed with EACCES: it finds
// what refused (the socket, or the first directory on its path this
// process cannot stat through) and whose group it is, as stat sees it.
func refused(path string, err error) error {
	denied := path
	var st fs.FileInfo
	for {
		s, serr := os.Stat(denied)
		if serr == nil {
			st = s
			break
		}
		parent := filepath.Dir(denied)
		if parent == denied {
			return err
		}
		denied = parent
	}
	if denied != path {
		// The deepest path stat reaches is the directory this process
		// may not search.
		if !st.IsDir() {
			return err
		}
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return err
	}
	e := &SocketRefusedError{
		Path: path, Denied: denied, Mode: st.Mode(), GID: int(sys.Gid),
		Owner: strconv.Itoa(int(sys.Uid)), Group: strconv.Itoa(int(sys.Gid)),
		User: strconv.Itoa(os.Geteuid()), Err: err,
	}
	if u, uerr := user.LookupId(e.Owner); uerr == nil {
		e.Owner = u.Username
	}
	if g, gerr := user.LookupGroupId(e.Group); gerr == nil {
		e.Group = g.Name
	}
	if u, uerr := user.LookupId(e.User); uerr == nil {
		e.User = u.Username
		if ids, gerr := u.GroupIds(); gerr == nil {
			for _, id := range ids {
				e.Listed = e.Listed || id == strconv.Itoa(e.GID)
			}
		}
	}
	if groups, gerr := os.Getgroups(); gerr == nil {
		for _, g := range groups {
			e.HeldGroup = e.HeldGroup || g == e.GID
		}
	}
	e.HeldGroup = e.HeldGroup || os.Getegid() == e.GID
	return e
}

// unreachable says why nobody answers on path, naming the path once.
func unreachable(path string, err error) error {
	cause := err
	var oe *net.OpError
	if errors.As(err, &oe) {
		cause = oe.Err // not "dial unix PATH: connect: ..."
		var se *os.SyscallError
		if errors.As(cause, &se) {
			cause = se.Err
		}
	}
	why := fmt.Sprintf("%s: %v", path, cause)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		why = "no socket at " + path
	case errors.Is(err, syscall.ECONNREFUSED):
		why = "nothing listens on " + path
	}
	return &unreachableError{why: why, err: err}
}

type unreachableError struct {
	why string
	err error
}

func (e *unreachableError) Error() string {
	return ErrUnreachable.Error() + ": " + e.why + " (is infermeshd running? use --socket or INFERMESH_SOCKET)"
}

func (e *unreachableError) Unwrap() []error { return []error{ErrUnreachable, e.err} }
