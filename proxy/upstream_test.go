package proxy

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infermesh/infermesh/placement"
)

// rawUpstream is an instance written at the byte level, to produce the
// framings and misbehaviours net/http's server never does. serve handles
// one connection; it returns after the last request it wants to answer.
type rawUpstream struct {
	ln    net.Listener
	conns atomic.Int32
	wg    sync.WaitGroup
	mu    sync.Mutex
	reqs  []*http.Request
	body  []string
}

func newRawUpstream(t *testing.T, serve func(u *rawUpstream, c net.Conn, br *bufio.Reader)) *rawUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &rawUpstream{ln: ln}
	var open sync.Map
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u.conns.Add(1)
			open.Store(c, true)
			u.wg.Add(1)
			go func() {
				defer u.wg.Done()
				defer c.Close()
				serve(u, c, bufio.NewReader(c))
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		open.Range(func(k, _ any) bool { k.(net.Conn).Close(); return true })
		u.wg.Wait()
	})
	return u
}

// read reads one request and records it.
func (u *rawUpstream) read(br *bufio.Reader) bool {
	req, err := http.ReadRequest(br)
	if err != nil {
		return false
	}
	b, _ := io.ReadAll(req.Body)
	u.mu.Lock()
	u.reqs = append(u.reqs, req)
	u.body = append(u.body, string(b))
	u.mu.Unlock()
	return true
}

func (u *rawUpstream) url() string { return "http://" + u.ln.Addr().String() }

func (e *env) register(base, model string) {
	e.t.Helper()
	if err := e.table.RegisterLocal("chat", placement.Local{Base: base, Model: model, API: "openai", Runtime: "test"}); err != nil {
		e.t.Fatal(err)
	}
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	return string(b)
}

// TestUpstreamFramings checks every way an instance may frame its response
// reaches the client intact, with the model rewritten, and that the
// connection is reused when the framing allows it.
func TestUpstreamFramings(t *testing.T) {
	const js = `{"model":"m","x":1}`
	for _, tt := range []struct {
		name      string
		resp      string // after the status line
		status    int
		want      string
		wantConns int32 // connections for two requests
	}{
		{"content-length", "Content-Type: application/json\r\nContent-Length: 19\r\n\r\n" + js, 200, `{"model":"chat","x":1}`, 1},
		{"chunked with trailers", "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\ne\r\nel\":\"m\",\"x\":1}\r\n0\r\nX-Trailer: t\r\n\r\n", 200, `{"model":"chat","x":1}`, 1},
		{"lowercase headers", "content-type: application/json\r\ncontent-length: 19\r\n\r\n" + js, 200, `{"model":"chat","x":1}`, 1},
		{"informational first", "\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 19\r\n\r\n" + js, 200, `{"model":"chat","x":1}`, 1},
		{"until close", "Content-Type: application/json\r\nConnection: close\r\n\r\n" + js, 200, `{"model":"chat","x":1}`, 2},
		{"no content", "\r\n", 204, "", 1},
		{"plain text error", "Content-Type: text/plain\r\nContent-Length: 4\r\n\r\nnope", 400, "nope", 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			status := "HTTP/1.1 " + strconv.Itoa(tt.status) + " " + http.StatusText(tt.status) + "\r\n"
			if tt.name == "informational first" {
				status = "HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n"
			}
			up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
				for u.read(br) {
					io.WriteString(c, status+tt.resp)
					if strings.Contains(tt.resp, "Connection: close") {
						return
					}
				}
			})
			e := newEnv(t, Config{})
			e.register(up.url(), "m")
			for i := range 2 {
				resp := e.post(pathChat, `{"model":"chat","messages":[]}`)
				if got := readAll(t, resp); resp.StatusCode != tt.status || got != tt.want {
					t.Fatalf("request %d = %d %q, want %d %q", i, resp.StatusCode, got, tt.status, tt.want)
				}
			}
			if got := up.conns.Load(); got != tt.wantConns {
				t.Errorf("connections to the instance = %d, want %d", got, tt.wantConns)
			}
		})
	}
}

// TestUpstreamStaleConnectionRetried: an instance that closes a keep-alive
// connection while it is idle must not fail the next request; it is sent
// again on a new connection.
func TestUpstreamStaleConnectionRetried(t *testing.T) {
	up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
		if u.read(br) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"model\":\"m\"}")
		}
		// and close without saying so
	})
	e := newEnv(t, Config{})
	e.register(up.url(), "m")
	for i := range 3 {
		resp := e.post(pathChat, `{"model":"chat"}`)
		if got := readAll(t, resp); resp.StatusCode != 200 || got != `{"model":"chat"}` {
			t.Fatalf("request %d = %d %q, want 200 and the rewritten body", i, resp.StatusCode, got)
		}
		time.Sleep(10 * time.Millisecond) // let the close land
	}
	if got := up.conns.Load(); got != 3 {
		t.Errorf("connections = %d, want 3 (one per request)", got)
	}
}

// TestUpstreamRequestHead checks what the instance receives: the path and
// the query, end-to-end headers (duplicates kept), the body
// pinned, and nothing hop-by-hop.
func TestUpstreamRequestHead(t *testing.T) {
	up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
		for u.read(br) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		}
	})
	e := newEnv(t, Config{})
	e.register(up.url()+"/", "m")
	req, _ := http.NewRequest(http.MethodPost, e.url+pathChat+"?api-version=2", strings.NewReader(`{"model":"chat","n":1}`))
	req.Header.Add("X-Multi", "a")
	req.Header.Add("X-Multi", "b")
	req.Header.Set("Content-Type", "text/plain")
	req.Header.Set("Te", "trailers")
	req.Header.Set("Authorization", "Bearer sk-app")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	resp.Body.Close()
	up.mu.Lock()
	defer up.mu.Unlock()
	if len(up.reqs) != 1 {
		t.Fatalf("instance got %d requests, want 1", len(up.reqs))
	}
	got := up.reqs[0]
	if got.URL.Path != pathChat || got.URL.RawQuery != "api-version=2" {
		t.Errorf("request target = %s, want %s?api-version=2", got.URL, pathChat)
	}
	if got.Host != up.ln.Addr().String() {
		t.Errorf("Host = %q, want the instance's", got.Host)
	}
	if v := got.Header.Values("X-Multi"); len(v) != 2 || v[0] != "a" || v[1] != "b" {
		t.Errorf("X-Multi = %v, want [a b]", v)
	}
	if v := got.Header.Values("Content-Type"); len(v) != 1 || v[0] != "application/json" {
		t.Errorf("Content-Type = %v, want [application/json]", v)
	}
	if got.Header.Get("Te") != "" || got.Header.Get("Authorization") != "Bearer sk-app" {
		t.Errorf("headers = %v, want Te dropped and Authorization kept (local instance)", got.Header)
	}
	if up.body[0] != `{"model":"m","n":1}` {
		t.Errorf("body = %s, want the model pinned", up.body[0])
	}
}

// TestUpstreamLongSSELineRewritten: an event longer than the relay's line
// buffer is still rewritten whole.
func TestUpstreamLongSSELineRewritten(t *testing.T) {
	pad := strings.Repeat("x", 20<<10)
	e := newEnv(t, Config{})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"pad":"`+pad+`","model":"m"}`+"\n\ndata: [DONE]\n\n")
	}), "m")
	resp := e.post(pathChat, `{"model":"chat","stream":true}`)
	want := `data: {"pad":"` + pad + `","model":"chat"}` + "\n\ndata: [DONE]\n\n"
	if got := readAll(t, resp); got != want {
		t.Errorf("stream (%d bytes) is not the %d-byte event rewritten", len(got), len(want))
	}
}

// TestUpstreamHeadTimeout: an instance that accepts the request but never
// answers yields 504 after UpstreamTimeout, and its connection is closed.
func TestUpstreamHeadTimeout(t *testing.T) {
	closed := make(chan struct{})
	up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
		u.read(br)
		_, _ = br.ReadByte() // blocks until the proxy gives up
		close(closed)
	})
	e := newEnv(t, Config{UpstreamTimeout: 100 * time.Millisecond})
	e.register(up.url(), "m")
	resp := e.post(pathChat, `{"model":"chat"}`)
	if body := readAll(t, resp); resp.StatusCode != http.StatusGatewayTimeout || !strings.Contains(body, "upstream_timeout") {
		t.Errorf("got %d %s, want 504 upstream_timeout", resp.StatusCode, body)
	}
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Error("the timed-out connection to the instance was not closed")
	}
}

// TestUpstreamPoolBounded: at most MaxIdleConnsPerUpstream idle connections
// are kept, and Shutdown closes them.
func TestUpstreamPoolBounded(t *testing.T) {
	release := make(chan struct{})
	up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
		for u.read(br) {
			<-release
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		}
	})
	// The pool is upstreamClient's own (http.Transport keeps its own).
	e := newEnv(t, Config{MaxIdleConnsPerUpstream: 2, Server: ServerInfermesh})
	e.register(up.url(), "m")
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			resp, err := http.Post(e.url+pathChat, "application/json", strings.NewReader(`{}`))
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	for up.conns.Load() < 4 {
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	host := up.ln.Addr().String()
	e.proxy.up.mu.Lock()
	idle := len(e.proxy.up.idle[host])
	e.proxy.up.mu.Unlock()
	if idle != 2 {
		t.Errorf("idle connections = %d, want 2", idle)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.proxy.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	e.proxy.up.mu.Lock()
	idle = len(e.proxy.up.idle[host])
	e.proxy.up.mu.Unlock()
	if idle != 0 {
		t.Errorf("idle connections after Shutdown = %d, want 0", idle)
	}
}

// TestUpstreamDeadlineKeptAcrossRequests: a pooled connection keeps the
// head deadline an earlier exchange set while most of the timeout is
// left; it must serve requests for several timeouts, and once that
// deadline has passed on an idle connection the instance closing it must
// still be seen (a request is never written onto it).
func TestUpstreamDeadlineKeptAcrossRequests(t *testing.T) {
	const timeout = 400 * time.Millisecond
	closeNow := make(chan struct{})
	closed := make(chan struct{})
	var first atomic.Bool
	up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
		isFirst := first.CompareAndSwap(false, true)
		if isFirst {
			// The test closes this one while it is idle in the pool.
			done := make(chan struct{})
			defer close(done)
			go func() {
				select {
				case <-closeNow:
					c.Close()
				case <-done:
				}
			}()
		}
		for {
			if !u.read(br) {
				if isFirst {
					close(closed)
				}
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"model\":\"m\"}")
		}
	})
	e := newEnv(t, Config{UpstreamTimeout: timeout, Server: ServerInfermesh})
	e.register(up.url(), "m")
	post := func(what string) {
		t.Helper()
		resp := e.post(pathChat, `{"model":"chat"}`)
		if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: got %d %s", what, resp.StatusCode, body)
		}
	}
	for start := time.Now(); time.Since(start) < 4*timeout; {
		post("busy connection")
	}
	if n := up.conns.Load(); n != 1 {
		t.Fatalf("connections to the instance = %d, want 1 (reused)", n)
	}
	// Until the pooled connection's deadline has passed.
	host := up.ln.Addr().String()
	e.proxy.up.mu.Lock()
	dl := time.Time{}
	if l := e.proxy.up.idle[host]; len(l) == 1 {
		dl = l[0].dl
	}
	e.proxy.up.mu.Unlock()
	if dl.IsZero() {
		t.Fatal("the pooled connection has no deadline left: nothing to check")
	}
	// An idle connection's deadline is not moved: the condition is the
	// clock passing it.
	waitFor(t, "the pooled connection's deadline to pass", func() bool { return time.Now().After(dl) })
	close(closeNow)
	<-closed
	post("after the instance closed the idle connection")
	if n := up.conns.Load(); n != 2 {
		t.Errorf("connections to the instance = %d, want 2", n)
	}
}
