package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/configs"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// readNotify reads sd_notify datagrams until one is not a file descriptor
// store message, and returns it with the names of the sockets stored
// before it (each checked to arrive with exactly one descriptor, then
// closed).
func readNotify(c *net.UnixConn, within time.Duration) (string, []string, error) {
	var stored []string
	deadline := time.Now().Add(within)
	for {
		_ = c.SetReadDeadline(deadline)
		buf, oob := make([]byte, 4096), make([]byte, 1024)
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil {
			return "", stored, err
		}
		var fds []int
		if oobn > 0 {
			msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				return "", stored, err
			}
			for _, m := range msgs {
				got, err := syscall.ParseUnixRights(&m)
				if err != nil {
					return "", stored, err
				}
				fds = append(fds, got...)
			}
		}
		for _, fd := range fds {
			syscall.Close(fd)
		}
		state := string(buf[:n])
		name, ok := strings.CutPrefix(state, "FDSTORE=1\nFDNAME=")
		if !ok {
			if len(fds) > 0 {
				return state, stored, fmt.Errorf("%q came with %d file descriptors", state, len(fds))
			}
			return state, stored, nil
		}
		if len(fds) != 1 {
			return state, stored, fmt.Errorf("%q came with %d file descriptors, want 1", state, len(fds))
		}
		stored = append(stored, name)
	}
}

// TestListeningSocketOutlivesRestart: the role port's listening socket
// that systemd keeps (here the test holds it, as systemd's file descriptor
// store would) is taken up by each agent started with it in LISTEN_FDS, and
// handed to the store again. A request sent while no agent runs waits in
// the kernel's queue and is answered by the next agent: the port is never
// closed across the restart.
func TestListeningSocketOutlivesRestart(t *testing.T) {
	notify := filepath.Join(t.TempDir(), "notify.sock")
	nconn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notify, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer nconn.Close()
	port := testnet.TCPPort(t, "127.0.0.1")
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	kept, err := net.Listen("tcp", addr) // systemd's copy: never accepted on here
	if err != nil {
		t.Fatal(err)
	}
	defer kept.Close()
	name := fdName(addr)

	start := func() *exec.Cmd {
		t.Helper()
		f, err := kept.(*net.TCPListener).File()
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		// LISTEN_PID must be the agent's pid: sh execs it, keeping its own.
		cmd := exec.Command("/bin/sh", "-c", `LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES="$1" exec "$2" -dev -dev-port "$3" -dev-token-delay 1ms`,
			"sh", name, bin, fmt.Sprint(port))
		cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+notify)
		cmd.ExtraFiles = []*os.File{f} // fd 3
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		// The states the previous agent sent after its READY come first.
		var stored []string
		for state := ""; state != "READY=1"; {
			var names []string
			var err error
			state, names, err = readNotify(nconn, 30*time.Second)
			if err != nil {
				t.Fatalf("sd_notify: %q, %v; want READY=1", state, err)
			}
			stored = append(stored, names...)
		}
		if len(stored) != 1 || stored[0] != name {
			t.Errorf("sockets stored before READY = %q, want [%q]", stored, name)
		}
		return cmd
	}
	stop := func(cmd *exec.Cmd) {
		t.Helper()
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	}
	chat := func() (int, error) {
		c := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := c.Post("http://"+addr+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}

	first := start()
	// The demo instance registers after its first probe.
	deadline := time.Now().Add(30 * time.Second)
	for code, err := chat(); code != http.StatusOK; code, err = chat() {
		if time.Now().After(deadline) {
			t.Fatalf("first agent: chat %d, %v", code, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop(first)

	// No agent runs: a request is queued, not refused.
	type result struct {
		code int
		err  error
	}
	queued := make(chan result, 1)
	go func() { code, err := chat(); queued <- result{code, err} }()
	second := start()
	r := <-queued
	// The second agent may take the request before its demo instance's
	// first probe: then it answers 503 (the instance is coming), never a
	// refused connection.
	if r.err != nil || (r.code != http.StatusOK && r.code != http.StatusServiceUnavailable) {
		t.Errorf("request sent while no agent ran: %d, %v; want an answer from the next agent", r.code, r.err)
	}
	stop(second)
}

// fakeFDStore is systemd's file descriptor store, as far as the agent
// sees it: it keeps the descriptors sent with FDSTORE=1 by name, drops a
// name's on FDSTOREREMOVE=1, and passes what it holds to the next agent
// in LISTEN_FDS order. Other states are delivered on states.
type fakeFDStore struct {
	t      *testing.T
	conn   *net.UnixConn
	path   string
	states chan string

	mu    sync.Mutex
	names []string
	files []*os.File
}

func newFakeFDStore(t *testing.T) *fakeFDStore {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	s := &fakeFDStore{t: t, conn: c, path: path, states: make(chan string, 64)}
	done := make(chan struct{})
	go s.run(done)
	t.Cleanup(func() {
		c.Close()
		<-done
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, f := range s.files {
			f.Close()
		}
	})
	return s
}

func (s *fakeFDStore) run(done chan struct{}) {
	defer close(done)
	for {
		buf, oob := make([]byte, 4096), make([]byte, 1024)
		n, oobn, _, _, err := s.conn.ReadMsgUnix(buf, oob)
		if err != nil {
			return
		}
		var fds []int
		if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				got, _ := syscall.ParseUnixRights(&m)
				fds = append(fds, got...)
			}
		}
		state := string(buf[:n])
		if name, ok := strings.CutPrefix(state, "FDSTORE=1\nFDNAME="); ok {
			s.mu.Lock()
			for _, fd := range fds {
				s.names = append(s.names, name)
				s.files = append(s.files, os.NewFile(uintptr(fd), name))
			}
			s.mu.Unlock()
			continue
		}
		for _, fd := range fds {
			syscall.Close(fd)
		}
		if name, ok := strings.CutPrefix(state, "FDSTOREREMOVE=1\nFDNAME="); ok {
			s.mu.Lock()
			var names []string
			var files []*os.File
			for i, n := range s.names {
				if n == name {
					s.files[i].Close()
					continue
				}
				names, files = append(names, n), append(files, s.files[i])
			}
			s.names, s.files = names, files
			s.mu.Unlock()
			continue
		}
		select {
		case s.states <- state:
		default:
		}
	}
}

// held returns the names of the descriptors held, in order.
func (s *fakeFDStore) held() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.names...)
}

// start runs the agent with what the store holds, as systemd starts the
// unit again, and waits for its READY=1.
func (s *fakeFDStore) start(args ...string) *exec.Cmd {
	s.t.Helper()
	// Duplicates for the child: the store may drop its own meanwhile.
	s.mu.Lock()
	names := strings.Join(s.names, ":")
	var files []*os.File
	for _, f := range s.files {
		fd, err := syscall.Dup(int(f.Fd()))
		if err != nil {
			s.mu.Unlock()
			s.t.Fatal(err)
		}
		files = append(files, os.NewFile(uintptr(fd), f.Name()))
	}
	s.mu.Unlock()
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	// LISTEN_PID must be the agent's pid: sh execs it, keeping its own.
	script := `n=$1; names=$2; b=$3; shift 3; LISTEN_PID=$$ LISTEN_FDS=$n LISTEN_FDNAMES="$names" exec "$b" "$@"`
	cmd := exec.Command("/bin/sh", append([]string{"-c", script, "sh", fmt.Sprint(len(files)), names, bin}, args...)...)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+s.path)
	cmd.ExtraFiles = files // fd 3 on
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	deadline := time.After(60 * time.Second)
	for {
		select {
		case st := <-s.states:
			if st == "READY=1" {
				return cmd
			}
		case <-deadline:
			s.t.Fatal("no READY=1 from the agent within 60 s")
		}
	}
}

// TestIdleConnectionOutlivesRestart: a kept-alive connection idle when the
// agent drains is neither closed nor reset: it is handed to the file
// descriptor store, and the next agent answers the next request on it,
// sent while no agent ran. What must hold: no request on the connection
// fails, and the store keeps no copy once the next agent took it.
func TestIdleConnectionOutlivesRestart(t *testing.T) {
	store := newFakeFDStore(t)
	port := testnet.TCPPort(t, "127.0.0.1")
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	idleName := idlePrefix + fdName(addr)
	args := []string{"-dev", "-dev-port", fmt.Sprint(port), "-dev-token-delay", "1ms"}
	stop := func(cmd *exec.Cmd) {
		t.Helper()
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	}

	first := store.start(args...)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	send := func() {
		t.Helper()
		const body = `{"model":"chat","messages":[{"role":"user","content":"hi"}]}`
		if _, err := fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"+
			"Content-Length: %d\r\n\r\n%s", addr, len(body), body); err != nil {
			t.Fatalf("sending on the kept-alive connection: %v", err)
		}
	}
	read := func() *http.Response {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
		resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodPost})
		if err != nil {
			t.Fatalf("the kept-alive connection: %v; want an answer", err)
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			t.Fatalf("reading the answer: %v", err)
		}
		resp.Body.Close()
		if resp.Close {
			t.Fatalf("answer %d says Connection: close; want the connection kept", resp.StatusCode)
		}
		return resp
	}
	// The demo instance registers after its first probe: 503 until then.
	testproc.WaitUntil(t, "the first agent's 200", 30*time.Second, func() bool { send(); return read().StatusCode == http.StatusOK })
	stop(first)
	// Sent before the agent exited; read by the store's goroutine.
	testproc.WaitUntil(t, "the idle connection in the store", 10*time.Second, func() bool { return slices.Contains(store.held(), idleName) })

	send() // no agent runs: the request waits in the kernel
	second := store.start(args...)
	if code := read().StatusCode; code != http.StatusOK && code != http.StatusServiceUnavailable {
		t.Errorf("request sent on the idle connection while no agent ran: %d; want the next agent's answer", code)
	}
	if got := store.held(); slices.Contains(got, idleName) {
		t.Errorf("store still holds %q once the next agent took it: %q", idleName, got)
	}
	send()
	if code := read().StatusCode; code != http.StatusOK && code != http.StatusServiceUnavailable {
		t.Errorf("next request on the adopted connection: %d", code)
	}
	stop(second)
}

// TestReloadTakesItsPortsOutOfTheStore: under systemd, a reload that
// removes a role takes its listening socket out of the file descriptor
// store, so that its port closes instead of queueing connections for the
// next agent, and a role the reload adds is served on its port, whose
// socket goes into the store like the others.
func TestReloadTakesItsPortsOutOfTheStore(t *testing.T) {
	store := newFakeFDStore(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "infermesh.yaml")
	chat, embed, rerank := testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1"), testnet.TCPPort(t, "127.0.0.1")
	addr := func(port int) string { return fmt.Sprintf("127.0.0.1:%d", port) }
	write := func(roles map[string]int) {
		t.Helper()
		text := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s/admin.sock}\nproxy: {health_interval: 20ms}\nroles:\n", dir, dir)
		for name, port := range roles {
			text += fmt.Sprintf("  %s: {port: %d, instance: {runtime: simulated}}\n", name, port)
		}
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	serves := func(port int, role string) bool {
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := c.Post("http://"+addr(port)+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"`+role+`","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode == http.StatusOK
	}
	write(map[string]int{"chat": chat, "embed": embed})
	cmd := store.start("-config", path)
	if got := store.held(); !slices.Contains(got, fdName(addr(chat))) || !slices.Contains(got, fdName(addr(embed))) {
		t.Fatalf("store holds %q, want both role ports", got)
	}
	testproc.WaitUntil(t, "embed serving", 30*time.Second, func() bool { return serves(embed, "embed") })

	write(map[string]int{"chat": chat, "rerank": rerank})
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testproc.WaitUntil(t, "the removed role's socket out of the store, the added one's in", 30*time.Second, func() bool {
		got := store.held()
		return !slices.Contains(got, fdName(addr(embed))) && slices.Contains(got, fdName(addr(rerank)))
	})
	testproc.WaitUntil(t, "the removed role's port closed", 30*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", addr(embed), time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	testproc.WaitUntil(t, "rerank serving", 30*time.Second, func() bool { return serves(rerank, "rerank") })
	if !serves(chat, "chat") {
		t.Error("chat no longer serves after the reload")
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v", err)
	}
}

// TestFDStoreMaxMatchesTheUnit: the agent's count of what fits in the
// store is the unit's FileDescriptorStoreMax.
func TestFDStoreMaxMatchesTheUnit(t *testing.T) {
	want := fmt.Sprintf("\nFileDescriptorStoreMax=%d\n", fdStoreMax)
	if !strings.Contains(string(configs.InfermeshdUnit), want) {
		t.Errorf("configs/infermeshd.service has no %q: fdStoreMax and the unit disagree", strings.TrimSpace(want))
	}
}
