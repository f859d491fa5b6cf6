package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testnet"
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
