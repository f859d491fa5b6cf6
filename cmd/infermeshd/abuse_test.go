package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// The abuse suite against the real process: what any local user can do to
// a role port, with the agent's own descriptor limit, signal handling and
// admin socket in play. The in-process suite is proxy/abuse_test.go.

// chatBody is an ordinary streamed chat request.
const chatBody = `{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`

// abuseAgent is a running infermeshd with role chat on port.
type abuseAgent struct {
	cmd    *exec.Cmd
	addr   string        // the role port
	sock   string        // the admin socket
	exited chan struct{} // closed when the process has exited, err set
	err    error         // its Wait error
}

// startAbuseAgent runs infermeshd with role chat in front of upstream,
// proxy settings proxyYAML (and proxy.server from INFERMESH_PROXY_SERVER,
// as the proxy suite takes it), and, when
// nofile > 0, an open-file limit of nofile (soft and hard, so the Go
// runtime cannot raise it), until it serves a chat completion.
func startAbuseAgent(t *testing.T, upstream, proxyYAML string, nofile int) *abuseAgent {
	t.Helper()
	dir := t.TempDir()
	a := &abuseAgent{sock: filepath.Join(dir, "admin.sock")}
	port := testnet.TCPPort(t, "127.0.0.1")
	a.addr = fmt.Sprintf("127.0.0.1:%d", port)
	if srv := os.Getenv("INFERMESH_PROXY_SERVER"); srv != "" {
		proxyYAML = strings.TrimPrefix(proxyYAML+", server: "+srv, ", ")
	}
	cfg := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nlog: {level: warn}\nproxy: {%s}\nroles:\n  chat: {port: %d, upstream: '%s'}\n",
		dir, a.sock, proxyYAML, port, upstream)
	cfgPath := filepath.Join(dir, "infermesh.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	if nofile > 0 {
		a.cmd = exec.Command("prlimit", fmt.Sprintf("--nofile=%d:%d", nofile, nofile), "--", bin, "-config", cfgPath)
	} else {
		a.cmd = exec.Command(bin, "-config", cfgPath)
	}
	a.cmd.Stderr = &syncWriter{w: &strings.Builder{}}
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a.exited = make(chan struct{})
	go func() {
		a.err = a.cmd.Wait()
		close(a.exited)
	}()
	t.Cleanup(func() {
		_ = a.cmd.Process.Kill()
		<-a.exited
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := a.chat(5 * time.Second); err == nil {
			return a
		} else if time.Now().After(deadline) {
			t.Fatalf("infermeshd never served a chat completion: %v\n%s", err, logsString(a.cmd))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// chat sends an ordinary chat request on a new connection and wants a
// whole stream ending in [DONE].
func (a *abuseAgent) chat(timeout time.Duration) error {
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Post("http://"+a.addr+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		return fmt.Errorf("%d %q", resp.StatusCode, b)
	}
	return nil
}

// admin GETs /v0/status over the admin socket.
func (a *abuseAgent) admin(timeout time.Duration) error {
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", a.sock)
		},
	}}
	resp, err := client.Get("http://infermesh.sock/v0/status")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	return nil
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command (which may hold spaces): state is field 3,
	// utime and stime are fields 14 and 15, in clock ticks (USER_HZ, 100).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// openFDs counts the process's open descriptors.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// raiseOwnNoFile lets this test process hold the client ends.
func raiseOwnNoFile(t *testing.T, want uint64) {
	t.Helper()
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	if rl.Cur < want {
		rl.Cur = min(want, rl.Max)
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
			t.Fatal(err)
		}
	}
	if rl.Cur < want {
		t.Fatalf("open-file limit %d, the test needs %d", rl.Cur, want)
	}
}

// TestFDExhaustion: an agent limited to 600 descriptors, flooded with
// more idle connections than that. It must not spin (CPU under half a
// core), must serve again once they close, and with the default
// connection cap ((600-256)/2 = 172) must keep its reserve: the admin
// socket answers and the process stays clear of its limit. With a cap
// above the limit, accept fails with EMFILE, which is backed off.
func TestFDExhaustion(t *testing.T) {
	const nofile, flood = 600, 900
	raiseOwnNoFile(t, 4096)
	srv := httptest.NewServer(&slowUpstream{})
	defer srv.Close()
	tests := []struct {
		name       string
		proxy      string
		reserve    bool // the admin socket answers and descriptors stay under the limit
		wantEMFILE bool
	}{
		{"default cap", "", true, false},
		{"cap above the fd limit", "max_conns: 100000", false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := startAbuseAgent(t, srv.URL, tt.proxy, nofile)
			pid := a.cmd.Process.Pid
			conns := make([]net.Conn, 0, flood)
			closeAll := func() {
				for _, c := range conns {
					c.Close()
				}
				conns = nil
			}
			defer closeAll()
			for range flood {
				c, err := net.DialTimeout("tcp", a.addr, 5*time.Second)
				if err != nil {
					break // the backlog is full: as refused as it gets
				}
				conns = append(conns, c)
			}
			t.Logf("%d idle connections open", len(conns))

			cpu0, t0 := cpuTime(t, pid), time.Now()
			// Saturated: the accept loop sees EMFILE (or the cap) now.
			deadline := time.Now().Add(3 * time.Second)
			for time.Now().Before(deadline) {
				if tt.reserve {
					if err := a.admin(10 * time.Second); err != nil {
						t.Fatalf("admin socket during saturation: %v", err)
					}
				}
				time.Sleep(200 * time.Millisecond)
			}
			cpu, wall := cpuTime(t, pid)-cpu0, time.Since(t0)
			fds := openFDs(t, pid)
			t.Logf("CPU %v over %v of saturation; %d of %d descriptors open", cpu, wall.Round(time.Millisecond), fds, nofile)
			if cpu > wall/2 {
				t.Errorf("CPU %v over %v of saturation: the accept loop spins", cpu, wall)
			}
			if tt.reserve && fds > nofile-100 {
				t.Errorf("%d of %d descriptors open: the cap leaves no reserve", fds, nofile)
			}
			if tt.wantEMFILE && fds < nofile {
				t.Errorf("%d of %d descriptors open: the flood never exhausted them", fds, nofile)
			}
			if got := strings.Contains(logsString(a.cmd), "too many open files"); got != tt.wantEMFILE {
				t.Errorf("log mentions EMFILE: %v, want %v:\n%.2000s", got, tt.wantEMFILE, logsString(a.cmd))
			}

			closeAll()
			deadline = time.Now().Add(20 * time.Second)
			for {
				err := a.chat(5 * time.Second)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no chat completion within 20s of the idle connections closing: %v", err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err := a.admin(10 * time.Second); err != nil {
				t.Errorf("admin socket after the flood: %v", err)
			}
		})
	}
}

// slowUpstream streams chat completions of a second or so; a request
// whose body mentions "stall" gets comment events without end, until
// cancelled, so a client that does not read stalls the proxy's writes.
type slowUpstream struct {
	stallBytes atomic.Int64
}

func (u *slowUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.WriteHeader(200) // health probes
		return
	}
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	if strings.Contains(string(body), "stall") {
		chunk := ": " + strings.Repeat("p", 16<<10) + "\n\n"
		for r.Context().Err() == nil {
			n, err := io.WriteString(w, chunk)
			u.stallBytes.Add(int64(n))
			if err != nil || rc.Flush() != nil {
				return
			}
		}
		return
	}
	for i := range 10 {
		fmt.Fprintf(w, "data: {\"model\":\"m\",\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
		_ = rc.Flush()
		select {
		case <-time.After(150 * time.Millisecond):
		case <-r.Context().Done():
			return
		}
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

// TestSIGTERMDuringAbuse: for each kind of abuse, SIGTERM while it goes
// on stops infermeshd with status 0 well within proxy.shutdown_timeout
// (30 s; body_timeout 60 s, so stalled bodies must be closed, not waited
// for), and an ordinary stream in flight at SIGTERM completes.
func TestSIGTERMDuringAbuse(t *testing.T) {
	const bound = 8 * time.Second // shutdown_timeout is 30s, the header timeout 10s, write_timeout 60s
	raiseOwnNoFile(t, 4096)
	up := &slowUpstream{}
	srv := httptest.NewServer(up)
	defer srv.Close()

	type abuse func(t *testing.T, a *abuseAgent, stop <-chan struct{}, track func(net.Conn))
	dial := func(t *testing.T, a *abuseAgent, track func(net.Conn)) net.Conn {
		c, err := net.DialTimeout("tcp", a.addr, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		track(c)
		return c
	}
	tests := []struct {
		name  string
		abuse abuse
	}{
		{"idle connections", func(t *testing.T, a *abuseAgent, _ <-chan struct{}, track func(net.Conn)) {
			for range 500 {
				dial(t, a, track)
			}
		}},
		{"slowloris", func(t *testing.T, a *abuseAgent, stop <-chan struct{}, track func(net.Conn)) {
			for range 50 {
				c := dial(t, a, track)
				fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nX-Slow: ", a.addr)
				go func() {
					for {
						select {
						case <-stop:
							return
						case <-time.After(200 * time.Millisecond):
							if _, err := c.Write([]byte("a")); err != nil {
								return
							}
						}
					}
				}()
			}
		}},
		{"stalled body", func(t *testing.T, a *abuseAgent, _ <-chan struct{}, track func(net.Conn)) {
			for range 20 {
				c := dial(t, a, track)
				fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: 100\r\n\r\n{", a.addr)
			}
		}},
		{"stalled reader", func(t *testing.T, a *abuseAgent, _ <-chan struct{}, track func(net.Conn)) {
			before := up.stallBytes.Load()
			c := dial(t, a, track)
			_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
			body := `{"model":"chat","stream":true,"stall":true}`
			fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s", a.addr, len(body), body)
			deadline := time.Now().Add(20 * time.Second)
			for up.stallBytes.Load()-before < 1<<20 { // the buffers are filling
				if time.Now().After(deadline) {
					t.Fatal("the stalled stream never started")
				}
				time.Sleep(10 * time.Millisecond)
			}
		}},
		{"16 MiB-declared flood", func(t *testing.T, a *abuseAgent, _ <-chan struct{}, track func(net.Conn)) {
			const declared = 16 << 20
			var wg sync.WaitGroup
			for range 6 {
				c := dial(t, a, track)
				wg.Add(1)
				go func() {
					defer wg.Done()
					_ = c.SetWriteDeadline(time.Now().Add(20 * time.Second))
					fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n", a.addr, declared)
					_, _ = c.Write(make([]byte, declared-1)) // refused over the memory bound: an error here is fine
				}()
			}
			wg.Wait()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := startAbuseAgent(t, srv.URL, "max_body_memory: 67108864", 0)
			stop := make(chan struct{})
			var conns []net.Conn
			var mu sync.Mutex
			defer func() {
				close(stop)
				mu.Lock()
				for _, c := range conns {
					c.Close()
				}
				mu.Unlock()
			}()
			tt.abuse(t, a, stop, func(c net.Conn) { mu.Lock(); conns = append(conns, c); mu.Unlock() })

			// An ordinary stream, in flight (its first event read) at SIGTERM.
			c, err := net.DialTimeout("tcp", a.addr, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s", a.addr, len(chatBody), chatBody)
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("ordinary stream during the abuse: %v %v", err, resp)
			}
			rb := bufio.NewReader(resp.Body)
			first, err := rb.ReadString('\n')
			if err != nil || !strings.HasPrefix(first, "data: ") {
				t.Fatalf("ordinary stream: first line %q, %v", first, err)
			}

			start := time.Now()
			if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			rest, rerr := io.ReadAll(rb)
			select {
			case <-a.exited:
				took, err := time.Since(start), a.err
				t.Logf("exited %v after SIGTERM", took.Round(time.Millisecond))
				if err != nil {
					t.Errorf("exit after SIGTERM: %v, want status 0\n%.3000s", err, logsString(a.cmd))
				}
				if took > bound {
					t.Errorf("exit %v after SIGTERM, want under %v", took, bound)
				}
			case <-time.After(bound + 10*time.Second):
				t.Fatalf("infermeshd still running %v after SIGTERM", bound+10*time.Second)
			}
			if rerr != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
				t.Errorf("the stream in flight at SIGTERM did not complete: %v, %q", rerr, rest)
			}
		})
	}
}
