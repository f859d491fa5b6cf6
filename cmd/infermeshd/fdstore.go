package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"go.uber.org/zap"
)

// Listening sockets that outlive the agent. Under systemd with
// FileDescriptorStoreMax= set (configs/infermeshd.service), every role
// port's and the shared port's listening socket is handed to systemd's file
// descriptor store (sd_notify FDSTORE=1) as soon as it is bound, and
// systemd hands it back to the next agent (LISTEN_FDS, LISTEN_FDNAMES) when
// the unit restarts or crashes. The socket is never closed in between: while
// the old agent drains and the new one starts, the kernel queues the apps'
// connections and the new agent accepts them, where they were refused
// before. `systemctl stop` empties the store and closes them.
//
// Idle client connections outlive the agent the same way. When the proxy
// drains, a kept-alive connection waiting for its next request is handed
// to the store (FDNAME idle_<listener's name>) instead of being closed
// under the client, who may be sending that request at that moment: the
// request then waits in the kernel, and the next agent, which takes the
// connections back with its listening socket (and removes them from the
// store at once), reads and answers it. Nothing of a connection handed
// over was read, and HTTP/1.1 keeps no state between requests, so the
// next agent serves it as a connection it has just accepted. At most
// fdStoreMax descriptors fit (the unit's FileDescriptorStoreMax); beyond
// them an idle connection closes as it does without systemd.

// fdStoreMax is configs/infermeshd.service's FileDescriptorStoreMax: the
// listening sockets and the idle connections handed over share it.
const fdStoreMax = 4096

// idlePrefix names the idle connections of a listening socket in the store.
const idlePrefix = "idle_"

// fdStore binds the proxy's listeners (agent.Options.Listen): a socket
// inherited from systemd for the same address when there is one, else a new
// one; either is stored with systemd. Safe for concurrent use.
type fdStore struct {
	mu        sync.Mutex
	inherited map[string]net.Listener // by FDNAME, not yet taken
	adopted   map[string][]net.Conn   // idle connections, by their listener's FDNAME, not yet taken
	stored    int                     // descriptors in systemd's store: listeners and idle connections handed over
	notify    func(state string, fds ...int) error
	log       *zap.Logger
}

// fdName names the listening socket of addr in systemd's store (names may
// not hold ':').
func fdName(addr string) string {
	return "tcp_" + strings.ReplaceAll(addr, ":", "_")
}

// newFDStore takes the sockets systemd passed to this process (when
// LISTEN_PID is ours) and clears the variables, so that children do not
// see them. notify sends to systemd with file descriptors attached.
func newFDStore(log *zap.Logger, notify func(state string, fds ...int) error) *fdStore {
	s := &fdStore{inherited: map[string]net.Listener{}, adopted: map[string][]net.Conn{}, notify: notify, log: log}
	pid, _ := strconv.Atoi(os.Getenv("LISTEN_PID"))
	n, _ := strconv.Atoi(os.Getenv("LISTEN_FDS"))
	names := strings.Split(os.Getenv("LISTEN_FDNAMES"), ":")
	for _, v := range []string{"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} {
		_ = os.Unsetenv(v)
	}
	if pid != os.Getpid() {
		return s
	}
	const firstFD = 3 // SD_LISTEN_FDS_START
	for i := range n {
		fd := firstFD + i
		syscall.CloseOnExec(fd)
		name := ""
		if i < len(names) {
			name = names[i]
		}
		f := os.NewFile(uintptr(fd), name)
		if lname, ok := strings.CutPrefix(name, idlePrefix); ok {
			c, err := net.FileConn(f) // a duplicate: f is closed below
			_ = f.Close()
			if err != nil {
				log.Warn("an idle connection from systemd is not a connection; dropped", zap.String("name", name), zap.Error(err))
				continue
			}
			s.adopted[lname] = append(s.adopted[lname], c)
			continue
		}
		ln, err := net.FileListener(f) // a duplicate: f is closed below
		_ = f.Close()
		if err != nil {
			log.Warn("a file descriptor from systemd is not a listening socket; dropped", zap.String("name", name), zap.Error(err))
			s.remove(name)
			continue
		}
		s.inherited[name] = ln
	}
	idle := 0
	for lname, cs := range s.adopted {
		// Ours now: systemd's copies must go, or a connection this agent
		// closes would stay open in the store.
		s.remove(idlePrefix + lname)
		idle += len(cs)
	}
	if len(s.inherited) > 0 || idle > 0 {
		log.Info("listening sockets kept across the restart", zap.Int("count", len(s.inherited)), zap.Int("idle_connections", idle))
	}
	return s
}

// listen implements agent.Options.Listen.
func (s *fdStore) listen(network, addr string) (net.Listener, error) {
	name := fdName(addr)
	s.mu.Lock()
	ln := s.inherited[name]
	delete(s.inherited, name)
	idle := s.adopted[name]
	delete(s.adopted, name)
	s.mu.Unlock()
	if ln != nil && ln.Addr().String() != addr {
		// Not what its name says (an address given by host name): start afresh.
		_ = ln.Close()
		s.remove(name)
		ln = nil
		closeAll(idle)
		idle = nil
	}
	if ln == nil {
		var err error
		if ln, err = net.Listen(network, addr); err != nil {
			return nil, err
		}
	}
	al := &adoptingListener{Listener: ln, idle: idle}
	if _, port, _ := net.SplitHostPort(addr); port != "0" {
		err := s.store(name, ln)
		if err == nil {
			return &storedListener{adoptingListener: al, s: s, name: idlePrefix + name}, nil
		}
		if !errors.Is(err, errNoNotifySocket) {
			s.log.Warn("cannot hand the listening socket to systemd; the port will close while the agent restarts",
				zap.String("addr", addr), zap.Error(err))
		}
	}
	return al, nil
}

// adoptingListener accepts the idle connections the previous agent
// handed over first, then new ones.
type adoptingListener struct {
	net.Listener
	mu   sync.Mutex
	idle []net.Conn
}

func (l *adoptingListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	if n := len(l.idle); n > 0 {
		c := l.idle[n-1]
		l.idle = l.idle[:n-1]
		l.mu.Unlock()
		return c, nil
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

func (l *adoptingListener) Close() error {
	l.mu.Lock()
	idle := l.idle
	l.idle = nil
	l.mu.Unlock()
	closeAll(idle)
	return l.Listener.Close()
}

// storedListener's socket is in systemd's store, and so are the idle
// connections it hands over (proxy.ConnHandover).
type storedListener struct {
	*adoptingListener
	s       *fdStore
	name    string // of its idle connections
	release sync.Once
}

// Release takes the listening socket out of systemd's store for good: a
// reload took its port away (the role removed, or moved to another port),
// so closing the listener must close the port rather than leave it
// queueing connections in the store for the next agent.
func (l *storedListener) Release() {
	l.release.Do(func() {
		l.s.remove(strings.TrimPrefix(l.name, idlePrefix))
		l.s.mu.Lock()
		l.s.stored--
		l.s.mu.Unlock()
	})
}

// HandOver stores c's socket with systemd for the next agent.
func (l *storedListener) HandOver(c net.Conn) error {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return fmt.Errorf("%T has no socket", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	l.s.mu.Lock()
	if l.s.stored >= fdStoreMax {
		l.s.mu.Unlock()
		return fmt.Errorf("systemd's file descriptor store is full (%d)", fdStoreMax)
	}
	l.s.stored++
	l.s.mu.Unlock()
	var nerr error
	if err := rc.Control(func(fd uintptr) { nerr = l.s.notify("FDSTORE=1\nFDNAME="+l.name, int(fd)) }); err != nil {
		nerr = err
	}
	if nerr != nil {
		l.s.mu.Lock()
		l.s.stored--
		l.s.mu.Unlock()
	}
	return nerr
}

func closeAll(cs []net.Conn) {
	for _, c := range cs {
		_ = c.Close()
	}
}

// store hands ln's socket to systemd's store (the kernel gives systemd its
// own descriptor; systemd ignores a socket it already holds). Not through
// a File: its Fd would put the shared socket into blocking mode, and the
// listener's Accept could no longer be interrupted by Close.
func (s *fdStore) store(name string, ln net.Listener) error {
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return fmt.Errorf("%T is not a TCP listener", ln)
	}
	rc, err := tl.SyscallConn()
	if err != nil {
		return err
	}
	var nerr error
	if err := rc.Control(func(fd uintptr) { nerr = s.notify("FDSTORE=1\nFDNAME="+name, int(fd)) }); err != nil {
		return err
	}
	if nerr == nil {
		s.mu.Lock()
		s.stored++
		s.mu.Unlock()
	}
	return nerr
}

// releaseUnused closes the inherited sockets no listener took (a role or
// port removed from the config) and removes them from systemd's store.
// Call it once every listener is bound.
func (s *fdStore) releaseUnused() {
	s.mu.Lock()
	left, idle := s.inherited, s.adopted
	s.inherited, s.adopted = map[string]net.Listener{}, map[string][]net.Conn{}
	s.mu.Unlock()
	for name, ln := range left {
		_ = ln.Close()
		s.remove(name)
		s.log.Info("listening socket no longer configured; closed", zap.String("name", name))
	}
	for _, cs := range idle {
		closeAll(cs)
	}
}

func (s *fdStore) remove(name string) {
	if name != "" {
		_ = s.notify("FDSTOREREMOVE=1\nFDNAME=" + name)
	}
}

// errNoNotifySocket: not started by systemd (no $NOTIFY_SOCKET).
var errNoNotifySocket = errors.New("no systemd notification socket")

// sdNotifyFDs sends state to systemd's notification socket with fds
// attached (SCM_RIGHTS). An unconnected socket: Go's WriteMsgUnix refuses
// a connected one.
func sdNotifyFDs(state string, fds ...int) error {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return errNoNotifySocket
	}
	sock, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(sock)
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	// A leading '@' names an abstract socket; SockaddrUnix maps it.
	return syscall.Sendmsg(sock, []byte(state), oob, &syscall.SockaddrUnix{Name: path}, 0)
}
