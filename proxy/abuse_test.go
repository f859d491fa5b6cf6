package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testproc"
	"github.com/infermesh/infermesh/placement"
)

// The abuse suite: what any local user can do to a loopback port. Each
// case states what must hold: other clients keep getting answers, memory
// stays under the configured bound, and Shutdown (SIGTERM) ends promptly
// in the middle of it. Every wait is bounded.

// abuseEnv is a proxy with tight limits in front of the demo model.
func abuseEnv(t *testing.T, cfg Config) (*env, string) {
	t.Helper()
	e := newEnv(t, cfg)
	e.demo(0)
	return e, strings.TrimPrefix(e.url, "http://")
}

// answered asserts a fresh client gets a chat answer.
func answered(t *testing.T, e *env, what string) {
	t.Helper()
	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Post(e.url+pathChat, "application/json", strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatalf("%s: another client got no answer: %v", what, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: another client got %d %s", what, resp.StatusCode, b)
	}
}

// shutdownPromptly asserts Shutdown, given far longer than any timeout
// under test, ends cleanly (ctx not exhausted) while the abuse goes on.
func shutdownPromptly(t *testing.T, e *env) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.proxy.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown during the abuse: %v", err)
	}
}

// dialMany opens n connections to addr (closed at cleanup).
func dialMany(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := net.DialTimeout("tcp", addr, 10*time.Second)
		if err != nil {
			t.Fatalf("dial %d: %v", len(conns), err)
		}
		conns = append(conns, c)
	}
	return conns
}

// raiseNoFile raises the soft open-file limit toward the hard one and
// returns the soft limit in effect.
func raiseNoFile(t *testing.T) int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	if rl.Cur < rl.Max {
		old := rl.Cur
		rl.Cur = min(rl.Max, 1<<16)
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil {
			t.Cleanup(func() {
				rl.Cur = old
				_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
			})
		}
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
	}
	return int(rl.Cur)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testproc.WaitUntil(t, what, 20*time.Second, cond)
}

// TestAbuseIdleConnections: thousands of idle connections, more than the
// cap, do not starve other clients: near the cap idle ones are closed.
func TestAbuseIdleConnections(t *testing.T) {
	limit := raiseNoFile(t)
	n := min(3000, (limit-200)/2) // each connection is two descriptors here
	e, addr := abuseEnv(t, Config{MaxConns: n / 2})
	conns := dialMany(t, addr, n)
	answered(t, e, fmt.Sprintf("%d idle connections, cap %d", n, n/2))
	if open := e.proxy.conns.open.Load(); open > int64(n/2) {
		t.Errorf("%d connections open, over the cap of %d", open, n/2)
	}
	_ = conns
	shutdownPromptly(t, e)
}

// TestAbuseConnectionCapAnswers503: at the cap with no idle connection to
// close, a new connection is answered 503 with Retry-After, not left
// hanging.
func TestAbuseConnectionCapAnswers503(t *testing.T) {
	e := newEnv(t, Config{MaxConns: 4})
	arrived := make(chan struct{}, 4)
	release := make(chan struct{})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release // four requests held at the instance keep their connections busy
	}), "m")
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer free()
	addr := strings.TrimPrefix(e.url, "http://")
	for _, c := range dialMany(t, addr, 4) {
		body := `{"model":"chat"}`
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s", pathChat, addr, len(body), body)
	}
	for range 4 {
		select {
		case <-arrived:
		case <-time.After(20 * time.Second):
			t.Fatal("the four requests did not reach the instance")
		}
	}
	c := dialMany(t, addr, 1)[0]
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the answer at the cap: %v", err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Errorf("at the cap: %d Retry-After %q, want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	free()
	shutdownPromptly(t, e)
}

// TestAbuseSlowloris: a head sent a byte at a time is cut at the
// read-header timeout; others are served meanwhile.
func TestAbuseSlowloris(t *testing.T) {
	e, addr := abuseEnv(t, Config{HeaderTimeout: 300 * time.Millisecond})
	conns := dialMany(t, addr, 50)
	var wg sync.WaitGroup
	cut := make(chan int, len(conns))
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			head := "POST " + pathChat + " HTTP/1.1\r\nHost: " + addr + "\r\nX-Slow: " + strings.Repeat("s", 100)
			for j := 0; j < len(head); j++ {
				if _, err := c.Write([]byte{head[j]}); err != nil {
					cut <- i
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	answered(t, e, "50 slowloris connections")
	wg.Wait() // each is cut: its writes fail once the server closed it
	if len(cut) != len(conns) {
		t.Errorf("%d of %d slow heads were cut", len(cut), len(conns))
	}
	shutdownPromptly(t, e)
}

// TestAbuseStalledBody: a body that stops arriving is answered 408 after
// the body timeout, and Shutdown does not wait for it.
func TestAbuseStalledBody(t *testing.T) {
	e, addr := abuseEnv(t, Config{BodyTimeout: 300 * time.Millisecond})
	c := dialMany(t, addr, 1)[0]
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: 100\r\n\r\n{", pathChat, addr)
	_ = c.SetDeadline(time.Now().Add(15 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	var ne net.Error
	switch {
	case err == nil && resp.StatusCode != http.StatusRequestTimeout:
		t.Errorf("stalled body: %d, want 408", resp.StatusCode)
	case err != nil && errors.As(err, &ne) && ne.Timeout():
		t.Fatalf("stalled body: still held after the body timeout: %v", err)
	case err != nil:
		// net/http's server (proxy.server std) closes the connection
		// at a body read timeout instead of answering 408.
	}
	answered(t, e, "a stalled body")

	// SIGTERM during stalled bodies: Shutdown closes them at once instead
	// of waiting for the body timeout.
	e2, addr2 := abuseEnv(t, Config{BodyTimeout: time.Hour})
	for _, c := range dialMany(t, addr2, 20) {
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: 100\r\n\r\n{", pathChat, addr2)
	}
	waitFor(t, "twenty stalled bodies", func() bool { return e2.proxy.conns.open.Load() == 20 })
	answered(t, e2, "20 stalled bodies")
	shutdownPromptly(t, e2)
}

// stalledReader makes e's instance stream comment events without end
// and opens a stream that is never read, so the proxy's writes fill the
// socket buffers and stall. cancelled closes when the instance's request
// is cancelled; wrote counts the bytes it sent.
func stalledReader(t *testing.T, e *env) (cancelled chan struct{}, wrote *atomic.Int64) {
	t.Helper()
	cancelled, wrote = make(chan struct{}), new(atomic.Int64)
	var once sync.Once
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		// Comment events: nothing to rewrite, so the buffers fill fast.
		chunk := ": " + strings.Repeat("p", 16<<10) + "\n\n"
		for r.Context().Err() == nil {
			n, err := io.WriteString(w, chunk)
			wrote.Add(int64(n))
			if err != nil {
				break
			}
			_ = rc.Flush()
		}
		once.Do(func() { close(cancelled) })
	}), "m")
	addr := strings.TrimPrefix(e.url, "http://")
	c := dialMany(t, addr, 1)[0]
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetReadBuffer(4 << 10)
	}
	body := `{"model":"chat","stream":true}`
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s", pathChat, addr, len(body), body)
	return cancelled, wrote
}

// TestAbuseShutdownGrace: with header and write timeouts of an hour, a
// slowloris and a stalled reader do not hold Shutdown: a request head
// still arriving and a blocked write get shutdownGrace. (The stalled
// reader holds the only instance slot, so no other client is asked.)
func TestAbuseShutdownGrace(t *testing.T) {
	tests := []struct {
		name  string
		abuse func(t *testing.T, e *env, addr string)
	}{
		{"slowloris", func(t *testing.T, e *env, addr string) {
			for _, c := range dialMany(t, addr, 20) {
				fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nX-Slow: s", pathChat, addr)
			}
			waitFor(t, "twenty slow heads", func() bool { return e.proxy.conns.open.Load() == 20 })
			answered(t, e, "20 slow heads")
		}},
		{"stalled reader", func(t *testing.T, e *env, _ string) {
			_, wrote := stalledReader(t, e)
			waitFor(t, "a stalled stream", func() bool { return wrote.Load() > 1<<20 })
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, addr := abuseEnv(t, Config{HeaderTimeout: time.Hour, WriteTimeout: time.Hour})
			tt.abuse(t, e, addr)
			shutdownPromptly(t, e)
		})
	}
}

// TestAbuseStalledReader: a client that stops reading a stream is cut at
// the write timeout, which frees the instance (its request is cancelled).
func TestAbuseStalledReader(t *testing.T) {
	e := newEnv(t, Config{WriteTimeout: 300 * time.Millisecond})
	cancelled, _ := stalledReader(t, e)
	select {
	case <-cancelled:
	case <-time.After(30 * time.Second):
		t.Fatal("the instance's request was not cancelled: a stalled reader holds it")
	}
	answered(t, e, "a stalled reader")
	shutdownPromptly(t, e)
}

// rss returns the process's resident set size in bytes.
func rss(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestAbuseBodyFlood: connections declaring 16 MiB bodies that send part
// and stall hold memory only as bytes arrive, within MaxBodyMemory; past
// it they are refused 503 with Retry-After, others are still served, and
// Shutdown ends at once.
func TestAbuseBodyFlood(t *testing.T) {
	const bound = 32 << 20
	e, addr := abuseEnv(t, Config{MaxBodyMemory: bound, BodyTimeout: time.Minute})
	base := rss(t)
	runtime.GC()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	baseHeap := ms0.HeapAlloc
	const n = 120
	conns := dialMany(t, addr, n)
	chunk := make([]byte, 1<<20)
	for i := range chunk {
		chunk[i] = ' '
	}
	var wg sync.WaitGroup
	statuses := make(chan int, n)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n{", pathChat, addr, 16<<20)
			// 1 MiB each: 120 MiB sent in all, four times the bound.
			if _, err := c.Write(chunk); err != nil {
				return
			}
			// A refused body is answered at once; one held is not (the
			// deadline ends the wait).
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
				if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
					statuses <- -1
					return
				}
				statuses <- resp.StatusCode
			}
		}()
	}
	wg.Wait()
	close(statuses)
	refused := 0
	for s := range statuses {
		if s == -1 {
			t.Error("a 503 without Retry-After")
		}
		if s == http.StatusServiceUnavailable {
			refused++
		}
	}
	if refused == 0 {
		t.Error("no flooding connection was refused 503: 120 MiB of bodies were all held under a 32 MiB bound")
	}
	if used := e.proxy.bodyMem.used.Load(); used > bound {
		t.Errorf("body memory in flight %d, over the bound %d", used, bound)
	}
	// What the proxy holds (the live heap after a collection): the
	// charged bound plus the uncharged first bodyFree of each body, plus
	// 32 MiB for connections, goroutines and the test's own clients.
	// Without the bound (and with buffers sized to the declared length)
	// the flood holds 120 MiB of body bytes and more.
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	if limit := uint64(bound + n*bodyFree + 32<<20); ms.HeapAlloc > baseHeap+limit {
		t.Errorf("live heap grew by %d MiB, want under %d MiB", (ms.HeapAlloc-baseHeap)>>20, limit>>20)
	}
	// RSS also counts memory the runtime has freed but not yet returned,
	// and the race detector's shadow of it: a loose check.
	if grew := rss(t) - base; grew > 8*bound {
		t.Errorf("RSS grew by %d MiB, want under %d MiB", grew>>20, 8*bound>>20)
	}
	answered(t, e, "a 16 MiB-declared flood")
	shutdownPromptly(t, e)
}

// TestMeshHopHeaderAllowlist: only MeshHeaders travel to a peer; every
// credential, whatever its name, stays on this host.
func TestMeshHopHeaderAllowlist(t *testing.T) {
	var got http.Header
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"chat"}`)
	}))
	defer peer.Close()
	e := newEnv(t, Config{Resolver: fakeResolver{{Kind: placement.KindRemote, Node: "b"}}, Remote: loopRemote{"b": peer.URL}})
	resp := e.post(pathChat, `{"model":"chat"}`,
		"Authorization", "Bearer sk-app", "X-Api-Key", "k1", "Api-Key", "k2", "Cookie", "c=1",
		"Openai-Organization", "org", "X-Custom", "v", "X-Request-Id", "r1", "User-Agent", "ua", "Idempotency-Key", "i1")
	readAll(t, resp)
	for _, h := range []string{"Authorization", "X-Api-Key", "Api-Key", "Cookie", "Openai-Organization", "X-Custom"} {
		if v := got.Get(h); v != "" {
			t.Errorf("%s = %q reached the peer", h, v)
		}
	}
	for h, want := range map[string]string{"X-Request-Id": "r1", "User-Agent": "ua", "Idempotency-Key": "i1", RoleHeader: "chat"} {
		if v := got.Get(h); v != want {
			t.Errorf("%s = %q at the peer, want %q", h, v, want)
		}
	}
}
