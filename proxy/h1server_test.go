package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// h1Env is an h1Server on a loopback port serving h.
type h1Env struct {
	t    *testing.T
	srv  *h1Server
	addr string
	done chan error
}

func newH1Env(t *testing.T, cfg h1Config, h http.Handler) *h1Env {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &h1Env{t: t, srv: newH1Server(h, cfg), addr: ln.Addr().String(), done: make(chan error, 1)}
	go func() { e.done <- e.srv.Serve(ln) }()
	t.Cleanup(func() {
		e.srv.Close()
		if err := <-e.done; !errors.Is(err, errServerClosed) {
			t.Errorf("Serve returned %v, want errServerClosed", err)
		}
	})
	return e
}

func (e *h1Env) dial() (net.Conn, *bufio.Reader) {
	e.t.Helper()
	c, err := net.Dial("tcp", e.addr)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	return c, bufio.NewReader(c)
}

// rawResp is a response read off the wire.
type rawResp struct {
	status int
	header http.Header
	body   string
	err    error // reading the body
}

func readRaw(t *testing.T, br *bufio.Reader, method string) rawResp {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	h := resp.Header.Clone()
	if resp.ContentLength >= 0 && h.Get("Content-Length") == "" && method != http.MethodHead {
		h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if len(resp.TransferEncoding) > 0 {
		h.Set("Transfer-Encoding", strings.Join(resp.TransferEncoding, ","))
	}
	if resp.Close {
		h.Set("Connection", "close")
	}
	return rawResp{status: resp.StatusCode, header: h, body: string(b), err: err}
}

// closedByServer reports whether the server closed c (a read sees EOF or
// a reset before the timeout).
func closedByServer(c net.Conn, br *bufio.Reader) bool {
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err := br.ReadByte()
	var ne net.Error
	return err != nil && !(errors.As(err, &ne) && ne.Timeout())
}

// stillServes reports whether c carries another request.
func stillServes(c net.Conn, br *bufio.Reader) bool {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n"); err != nil {
		return false
	}
	resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
	if err != nil {
		return false
	}
	_, err = io.Copy(io.Discard, resp.Body)
	return err == nil
}

// echo answers with the method, the path, the body and a few request
// fields.
var echo = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	out := fmt.Sprintf("%s %s?%s host=%s cl=%d te=%v x=%q body=%s", r.Method, r.URL.Path, r.URL.RawQuery, r.Host, r.ContentLength, r.TransferEncoding, r.Header.Get("X-Test"), b)
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	io.WriteString(w, out)
})

func TestH1RawExchanges(t *testing.T) {
	tests := []struct {
		name    string
		send    []string // written one after another
		want    []rawResp
		methods []string // of the requests, for reading responses; default POST
		closed  bool     // the server closes the connection after
	}{
		{
			name: "keep-alive, two requests",
			send: []string{
				"POST /a?q=1 HTTP/1.1\r\nHost: localhost\r\nX-Test: one\r\nContent-Length: 3\r\n\r\nabc",
				"POST /b HTTP/1.1\r\nhost: localhost:1\r\nx-test: two\r\ncontent-length: 2\r\n\r\nde",
			},
			want: []rawResp{
				{status: 200, body: `POST /a?q=1 host=localhost cl=3 te=[] x="one" body=abc`},
				{status: 200, body: `POST /b? host=localhost:1 cl=2 te=[] x="two" body=de`},
			},
		},
		{
			name: "pipelined requests are answered in order",
			send: []string{"GET /1 HTTP/1.1\r\nHost: h\r\n\r\nPOST /2 HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nxGET /3 HTTP/1.1\r\nHost: h\r\n\r\n"},
			want: []rawResp{
				{status: 200, body: `GET /1? host=h cl=0 te=[] x="" body=`},
				{status: 200, body: `POST /2? host=h cl=1 te=[] x="" body=x`},
				{status: 200, body: `GET /3? host=h cl=0 te=[] x="" body=`},
			},
			methods: []string{"GET", "POST", "GET"},
		},
		{
			name: "chunked request body",
			send: []string{"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n"},
			want: []rawResp{{status: 200, body: `POST /c? host=h cl=-1 te=[chunked] x="" body=abcde`}},
		},
		{
			name:   "HTTP/1.0 closes by default",
			send:   []string{"GET /x HTTP/1.0\r\n\r\n"},
			want:   []rawResp{{status: 200, body: `GET /x? host= cl=0 te=[] x="" body=`, header: http.Header{"Connection": {"close"}}}},
			closed: true,
		},
		{
			name: "HTTP/1.0 keep-alive",
			send: []string{"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "GET /y HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"},
			want: []rawResp{
				{status: 200, body: `GET /x? host= cl=0 te=[] x="" body=`, header: http.Header{"Connection": {"keep-alive"}}},
				{status: 200, body: `GET /y? host= cl=0 te=[] x="" body=`, header: http.Header{"Connection": {"keep-alive"}}},
			},
			methods: []string{"GET", "GET"},
		},
		{
			name:   "Connection: close is honoured",
			send:   []string{"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"},
			want:   []rawResp{{status: 200, header: http.Header{"Connection": {"close"}}, body: `GET /x? host=h cl=0 te=[] x="" body=`}},
			closed: true,
		},
		{
			name: "empty lines before a request are ignored",
			send: []string{"\r\n\r\nGET /x HTTP/1.1\r\nHost: h\r\n\r\n"},
			want: []rawResp{{status: 200, body: `GET /x? host=h cl=0 te=[] x="" body=`}},
		},
		{
			name: "absolute-form target",
			send: []string{"GET http://localhost:8/p?z HTTP/1.1\r\nHost: ignored\r\n\r\n"},
			want: []rawResp{{status: 200, body: `GET /p?z host=localhost:8 cl=0 te=[] x="" body=`}},
		},
		{
			name: "head arriving in pieces",
			send: []string{"POST /s HTTP/1.1\r\nHo", "st: h\r\nContent-Le", "ngth: 2\r\n", "\r\n", "o", "k"},
			want: []rawResp{{status: 200, body: `POST /s? host=h cl=2 te=[] x="" body=ok`}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newH1Env(t, h1Config{}, echo)
			c, br := e.dial()
			for _, s := range tt.send {
				if _, err := io.WriteString(c, s); err != nil {
					t.Fatal(err)
				}
				time.Sleep(time.Millisecond)
			}
			for i, want := range tt.want {
				m := "POST"
				if i < len(tt.methods) {
					m = tt.methods[i]
				} else if strings.HasPrefix(want.body, "GET") {
					m = "GET"
				}
				got := readRaw(t, br, m)
				if got.err != nil || got.status != want.status || got.body != want.body {
					t.Errorf("response %d = %d %q (err %v), want %d %q", i, got.status, got.body, got.err, want.status, want.body)
				}
				for k := range want.header {
					if g, w := got.header.Get(k), want.header.Get(k); g != w {
						t.Errorf("response %d %s = %q, want %q", i, k, g, w)
					}
				}
				if got.header.Get("Date") == "" {
					t.Errorf("response %d has no Date", i)
				}
			}
			if tt.closed && !closedByServer(c, br) {
				t.Error("connection left open, want it closed")
			}
			if !tt.closed && !stillServes(c, br) {
				t.Error("connection unusable, want it kept alive")
			}
		})
	}
}

func TestH1MalformedRequests(t *testing.T) {
	tests := []struct {
		name   string
		req    string
		status int
	}{
		{"garbage", "hello\r\n\r\n", 400},
		{"no version", "GET /\r\nHost: h\r\n\r\n", 400},
		{"bad version", "GET / HTTP/x\r\nHost: h\r\n\r\n", 400},
		{"HTTP/2", "GET / HTTP/2.0\r\nHost: h\r\n\r\n", 505},
		{"space in method", "G T / HTTP/1.1\r\nHost: h\r\n\r\n", 400},
		{"control in target", "GET /\x01 HTTP/1.1\r\nHost: h\r\n\r\n", 400},
		{"missing host", "GET / HTTP/1.1\r\n\r\n", 400},
		{"two hosts", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
		{"bad host", "GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400},
		{"space before colon", "GET / HTTP/1.1\r\nHost : h\r\n\r\n", 400},
		{"no colon", "GET / HTTP/1.1\r\nHost: h\r\nnocolon\r\n\r\n", 400},
		{"obs-fold", "GET / HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n 2\r\n\r\n", 400},
		{"control in value", "GET / HTTP/1.1\r\nHost: h\r\nX-A: 1\x002\r\n\r\n", 400},
		{"bad content-length", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n", 400},
		{"conflicting content-lengths", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400},
		{"content-length and chunked", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
		{"chunked in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
		{"unknown transfer coding", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
		{"stacked transfer codings", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501},
		{"unknown expectation", "POST / HTTP/1.1\r\nHost: h\r\nExpect: magic\r\nContent-Length: 1\r\n\r\nx", 417},
		{"headers too large", "GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + strings.Repeat("b", 70<<10) + "\r\n\r\n", 431},
		{"too many small headers", "GET / HTTP/1.1\r\nHost: h\r\n" + strings.Repeat("X-A: 0123456789\r\n", 5000) + "\r\n", 431},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			called := false
			e := newH1Env(t, h1Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { called = true }))
			c, br := e.dial()
			go io.WriteString(c, tt.req) // may block on a big head the server stops reading
			got := readRaw(t, br, "GET")
			if got.status != tt.status {
				t.Errorf("status = %d %s, want %d", got.status, got.body, tt.status)
			}
			if got.header.Get("Connection") != "close" || !closedByServer(c, br) {
				t.Error("the connection stayed open after a malformed request")
			}
			if called {
				t.Error("the handler saw a malformed request")
			}
		})
	}
}

func TestH1ExpectContinue(t *testing.T) {
	e := newH1Env(t, h1Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/refuse" {
			http.Error(w, "no", http.StatusRequestEntityTooLarge)
			return
		}
		echo(w, r)
	}))
	t.Run("body read: 100 first", func(t *testing.T) {
		c, br := e.dial()
		io.WriteString(c, "POST /ok HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
		line, err := br.ReadString('\n')
		if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
			t.Fatalf("first line = %q, %v; want 100 Continue", line, err)
		}
		if l, _ := br.ReadString('\n'); l != "\r\n" {
			t.Fatalf("after 100: %q", l)
		}
		io.WriteString(c, "hello")
		got := readRaw(t, br, "POST")
		if got.status != 200 || !strings.HasSuffix(got.body, "body=hello") {
			t.Errorf("got %d %q", got.status, got.body)
		}
		// Still usable.
		io.WriteString(c, "POST /ok HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nz")
		if got := readRaw(t, br, "POST"); got.status != 200 || !strings.HasSuffix(got.body, "body=z") {
			t.Errorf("second request: %d %q", got.status, got.body)
		}
	})
	t.Run("body refused: no 100, connection closed", func(t *testing.T) {
		c, br := e.dial()
		io.WriteString(c, "POST /refuse HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
		got := readRaw(t, br, "POST")
		if got.status != 413 || got.header.Get("Connection") != "close" {
			t.Errorf("got %d, Connection %q; want 413 and close", got.status, got.header.Get("Connection"))
		}
		if !closedByServer(c, br) {
			t.Error("connection left open with the body never sent")
		}
	})
	t.Run("curl-like client through net/http", func(t *testing.T) {
		tr := &http.Transport{ExpectContinueTimeout: 5 * time.Second}
		defer tr.CloseIdleConnections()
		body := strings.Repeat("x", 4096)
		req, _ := http.NewRequest("POST", "http://"+e.addr+"/ok", strings.NewReader(body))
		req.Header.Set("Expect", "100-continue")
		start := time.Now()
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "body="+body) {
			t.Errorf("got %d %.60q", resp.StatusCode, b)
		}
		if d := time.Since(start); d > 4*time.Second {
			t.Errorf("took %v: the client waited out its continue timeout", d)
		}
	})
}

func TestH1ResponseFraming(t *testing.T) {
	big := strings.Repeat("y", 3*pendingSize+7)
	tests := []struct {
		name   string
		req    string
		method string
		h      http.HandlerFunc
		cl     string // Content-Length header wanted ("" none)
		te     string
		body   string
		closed bool
	}{
		{"set length", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "2")
			io.WriteString(w, "ok")
		}, "2", "", "ok", false},
		{"small unknown length gets one", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "a")
			io.WriteString(w, "bc")
		}, "3", "", "abc", false},
		{"large unknown length is chunked", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			for i := 0; i < len(big); i += 1000 {
				io.WriteString(w, big[i:min(i+1000, len(big))])
			}
		}, "", "chunked", big, false},
		{"flushed is chunked", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "a")
			w.(http.Flusher).Flush()
			io.WriteString(w, "b")
		}, "", "chunked", "ab", false},
		{"HTTP/1.0 large unknown length ends with the connection", "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, big)
		}, "", "", big, true},
		{"empty", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {}, "0", "", "", false},
		{"HEAD keeps the length, sends no body", "HEAD / HTTP/1.1\r\nHost: h\r\n\r\n", "HEAD", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "5")
			io.WriteString(w, "hello")
		}, "5", "", "", false},
		{"HEAD of an unknown length", "HEAD / HTTP/1.1\r\nHost: h\r\n\r\n", "HEAD", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "hello")
		}, "5", "", "", false},
		{"204 has no body", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusNoContent)
			if _, err := io.WriteString(w, "x"); !errors.Is(err, http.ErrBodyNotAllowed) {
				panic(fmt.Sprintf("write on 204: %v", err))
			}
		}, "", "", "", false},
		{"short body closes", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "2")
			w.(http.Flusher).Flush()
		}, "2", "", "", true},
		{"handler asks to close", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Connection", "close")
			io.WriteString(w, "bye")
		}, "3", "", "bye", true},
		{"header injection neutralized", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", "GET", func(w http.ResponseWriter, r *http.Request) {
			w.Header()["X-Evil"] = []string{"a\r\nSet-Cookie: x=1"}
			io.WriteString(w, "ok")
		}, "2", "", "ok", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newH1Env(t, h1Config{}, tt.h)
			c, br := e.dial()
			io.WriteString(c, tt.req)
			resp, err := http.ReadResponse(br, &http.Request{Method: tt.method})
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			if tt.name == "short body closes" {
				if err == nil {
					t.Error("a short body read as complete")
				}
			} else if err != nil {
				t.Fatalf("body: %v", err)
			}
			if string(b) != tt.body {
				t.Errorf("body = %.40q (%d bytes), want %.40q (%d)", b, len(b), tt.body, len(tt.body))
			}
			if got := resp.Header.Get("Content-Length"); got != tt.cl {
				t.Errorf("Content-Length = %q, want %q", got, tt.cl)
			}
			if got := strings.Join(resp.TransferEncoding, ","); got != tt.te {
				t.Errorf("Transfer-Encoding = %q, want %q", got, tt.te)
			}
			if resp.Header.Get("Set-Cookie") != "" {
				t.Error("a header value with CRLF injected a header")
			}
			if n := br.Buffered(); n > 0 {
				t.Errorf("%d stray bytes after the response", n)
			}
			if tt.closed && !closedByServer(c, br) {
				t.Error("connection left open, want it closed")
			}
			if !tt.closed && !stillServes(c, br) {
				t.Error("connection unusable, want it kept alive")
			}
		})
	}
}

// TestH1StreamingAndAbort checks flushed events reach a net/http client one
// by one, and that an aborted handler leaves the client with an error, not
// a clean end.
func TestH1StreamingAndAbort(t *testing.T) {
	next := make(chan struct{})
	e := newH1Env(t, h1Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := 0; i < 3; i++ {
			fmt.Fprintf(w, "data: %d\n\n", i)
			if err := rc.Flush(); err != nil {
				return
			}
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
		if r.URL.Path == "/abort" {
			panic(http.ErrAbortHandler)
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	for _, path := range []string{"/ok", "/abort"} {
		t.Run(path, func(t *testing.T) {
			resp, err := http.Get("http://" + e.addr + path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			for i := 0; i < 3; i++ {
				line, err := br.ReadString('\n')
				if want := fmt.Sprintf("data: %d\n", i); err != nil || line != want {
					t.Fatalf("event %d = %q, %v; want %q", i, line, err, want)
				}
				br.ReadString('\n')
				next <- struct{}{}
			}
			rest, err := io.ReadAll(br)
			if path == "/ok" {
				if err != nil || string(rest) != "data: [DONE]\n\n" {
					t.Errorf("end = %q, %v", rest, err)
				}
			} else if err == nil {
				t.Errorf("aborted stream ended cleanly with %q", rest)
			}
		})
	}
}

func TestH1PanicAnswers500(t *testing.T) {
	e := newH1Env(t, h1Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Partial", "1")
		panic("boom")
	}))
	c, br := e.dial()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
	got := readRaw(t, br, "GET")
	if got.status != 500 || got.header.Get("X-Partial") != "" || got.header.Get("Connection") != "close" {
		t.Errorf("got %d %v, want a clean 500 that closes", got.status, got.header)
	}
	if !closedByServer(c, br) {
		t.Error("connection left open after a panic")
	}
}

// TestH1DisconnectCancels checks a client going away cancels the request
// context, both before any response byte and mid-stream, whatever the
// watch delay.
func TestH1DisconnectCancels(t *testing.T) {
	for _, delay := range []time.Duration{-1, time.Millisecond, 20 * time.Millisecond} {
		for _, midStream := range []bool{false, true} {
			t.Run(fmt.Sprintf("delay=%v/midstream=%v", delay, midStream), func(t *testing.T) {
				started := make(chan struct{})
				ended := make(chan error, 1)
				e := newH1Env(t, h1Config{WatchDelay: delay}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					io.ReadAll(r.Body)
					if midStream {
						io.WriteString(w, "data: x\n\n")
						w.(http.Flusher).Flush()
					}
					close(started)
					select {
					case <-r.Context().Done():
						ended <- r.Context().Err()
					case <-time.After(5 * time.Second):
						ended <- errors.New("request context never ended")
					}
				}))
				c, _ := e.dial()
				io.WriteString(c, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}")
				<-started
				c.Close()
				if err := <-ended; !errors.Is(err, context.Canceled) {
					t.Errorf("handler saw %v, want its context canceled", err)
				}
			})
		}
	}
}

// TestH1SlowRequestsKeepWorking runs requests that outlive the watch delay
// back to back and pipelined: the watcher must neither cancel them nor
// steal bytes of the next request.
func TestH1SlowRequestsKeepWorking(t *testing.T) {
	e := newH1Env(t, h1Config{WatchDelay: time.Millisecond}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		select {
		case <-time.After(5 * time.Millisecond):
		case <-r.Context().Done():
			http.Error(w, "canceled", 499)
			return
		}
		w.Write(b)
	}))
	c, br := e.dial()
	var all strings.Builder
	for i := 0; i < 6; i++ {
		fmt.Fprintf(&all, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\n%d", i)
	}
	io.WriteString(c, all.String()) // pipelined
	for i := 0; i < 6; i++ {
		if got := readRaw(t, br, "POST"); got.status != 200 || got.body != strconv.Itoa(i) {
			t.Fatalf("pipelined %d: %d %q", i, got.status, got.body)
		}
	}
	for i := 0; i < 6; i++ {
		fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\n%d", i)
		if got := readRaw(t, br, "POST"); got.status != 200 || got.body != strconv.Itoa(i) {
			t.Fatalf("sequential %d: %d %q", i, got.status, got.body)
		}
	}
}

func TestH1Timeouts(t *testing.T) {
	e := newH1Env(t, h1Config{ReadHeaderTimeout: 50 * time.Millisecond, IdleTimeout: 100 * time.Millisecond}, echo)
	t.Run("read header", func(t *testing.T) {
		c, br := e.dial()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n") // never ends
		start := time.Now()
		if !closedByServer(c, br) {
			t.Fatal("a stalled head kept the connection")
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("closed after %v", d)
		}
	})
	t.Run("idle", func(t *testing.T) {
		c, br := e.dial()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		if got := readRaw(t, br, "GET"); got.status != 200 {
			t.Fatalf("status %d", got.status)
		}
		if !closedByServer(c, br) {
			t.Fatal("an idle connection stayed open")
		}
	})
}

func TestH1Shutdown(t *testing.T) {
	// The drain never closes a connection a request may be on its way
	// over: what holds is that every request sent on a kept-alive
	// connection after Shutdown began is answered, with "Connection:
	// close", and only a connection that carried nothing for all of
	// DrainIdle is closed.
	t.Run("drains in-flight, answers idle connections with Connection: close", func(t *testing.T) {
		release := make(chan struct{})
		releaseOnce := sync.OnceFunc(func() { close(release) })
		defer releaseOnce() // a failed assertion must not leave the handler waiting
		inFlight := make(chan struct{})
		e := newH1Env(t, h1Config{DrainIdle: 300 * time.Millisecond}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/slow" {
				io.WriteString(w, "part1 ")
				w.(http.Flusher).Flush()
				close(inFlight)
				<-release
			}
			io.WriteString(w, "done")
		}))
		idle, idleBR := e.dial()
		io.WriteString(idle, "GET /fast HTTP/1.1\r\nHost: h\r\n\r\n")
		readRaw(t, idleBR, "GET")
		quiet, quietBR := e.dial() // carries nothing during the drain
		io.WriteString(quiet, "GET /fast HTTP/1.1\r\nHost: h\r\n\r\n")
		readRaw(t, quietBR, "GET")
		busy, busyBR := e.dial()
		io.WriteString(busy, "GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
		<-inFlight
		shut := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			shut <- e.srv.Shutdown(ctx)
		}()
		waitFor(t, "Shutdown to begin", e.srv.stopping.Load)
		if _, err := net.DialTimeout("tcp", e.addr, time.Second); err == nil {
			t.Error("still accepting after Shutdown")
		}
		// The next request on a connection idle when the drain began.
		io.WriteString(idle, "GET /fast HTTP/1.1\r\nHost: h\r\n\r\n")
		if got := readRaw(t, idleBR, "GET"); got.body != "done" || got.header.Get("Connection") != "close" {
			t.Errorf("request on an idle connection during the drain = %d %q, Connection %q; want done, with Connection: close",
				got.status, got.body, got.header.Get("Connection"))
		}
		if !closedByServer(idle, idleBR) {
			t.Error("connection kept after its Connection: close response")
		}
		releaseOnce()
		got := readRaw(t, busyBR, "GET")
		if got.err != nil || got.body != "part1 done" {
			t.Errorf("in-flight response = %q, %v; want it completed", got.body, got.err)
		}
		// Its head went out before the drain, without Connection: close:
		// the client may send another request, which is answered.
		if got.header.Get("Connection") == "close" {
			t.Fatalf("a response begun before the drain says Connection: close")
		}
		io.WriteString(busy, "GET /fast HTTP/1.1\r\nHost: h\r\n\r\n")
		if got := readRaw(t, busyBR, "GET"); got.body != "done" || got.header.Get("Connection") != "close" {
			t.Errorf("request after a stream that began before the drain = %q, Connection %q; want done, with Connection: close",
				got.body, got.header.Get("Connection"))
		}
		if err := <-shut; err != nil {
			t.Errorf("Shutdown = %v", err)
		}
		for _, c := range []struct {
			name string
			c    net.Conn
			br   *bufio.Reader
		}{{"busy", busy, busyBR}, {"quiet", quiet, quietBR}} {
			if !closedByServer(c.c, c.br) {
				t.Errorf("%s connection left open after Shutdown returned", c.name)
			}
		}
		if err := e.srv.Shutdown(context.Background()); err != nil {
			t.Errorf("second Shutdown = %v", err)
		}
	})
	t.Run("hands idle connections over with nothing read", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		hl := &handoverListener{Listener: ln}
		srv := newH1Server(echo, h1Config{DrainIdle: time.Hour})
		served := make(chan error, 1)
		go func() { served <- srv.Serve(hl) }()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		br := bufio.NewReader(c)
		io.WriteString(c, "GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
		readRaw(t, br, "GET")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// DrainIdle is an hour: Shutdown returns because the connection
		// was handed over, not closed.
		if err := srv.Shutdown(ctx); err != nil {
			t.Fatalf("Shutdown = %v", err)
		}
		if err := <-served; !errors.Is(err, errServerClosed) {
			t.Errorf("Serve = %v", err)
		}
		got := hl.taken()
		if len(got) != 1 {
			t.Fatalf("connections handed over = %d, want 1", len(got))
		}
		defer got[0].Close()
		// The next request reaches the descriptor handed over, whole: the
		// next agent serves it.
		io.WriteString(c, "GET /b HTTP/1.1\r\nHost: h\r\n\r\n")
		next := newH1Server(echo, h1Config{})
		one := &oneConnListener{c: got[0], done: make(chan struct{})}
		go next.Serve(one)
		defer next.Close()
		if r := readRaw(t, br, "GET"); !strings.HasPrefix(r.body, "GET /b?") {
			t.Errorf("request after the handover = %d %q; want it served by the next server", r.status, r.body)
		}
	})
	t.Run("deadline cuts what is left", func(t *testing.T) {
		inFlight := make(chan struct{})
		canceled := make(chan struct{})
		e := newH1Env(t, h1Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.(http.Flusher).Flush()
			close(inFlight)
			<-r.Context().Done()
			close(canceled)
		}))
		c, br := e.dial()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		<-inFlight
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		if err := e.srv.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Shutdown = %v, want the deadline", err)
		}
		<-canceled
		if got := readRaw(t, br, "GET"); got.err == nil {
			t.Errorf("cut response read as complete: %q", got.body)
		}
		if !closedByServer(c, br) {
			t.Error("connection left open after the deadline")
		}
	})
}

// TestH1ConcurrentClients drives the server through net/http's client
// from many goroutines (run with -race).
func TestH1ConcurrentClients(t *testing.T) {
	e := newH1Env(t, h1Config{WatchDelay: time.Microsecond}, echo)
	tr := &http.Transport{MaxIdleConnsPerHost: 8}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				body := fmt.Sprintf("g%d-%d", g, i)
				resp, err := cl.Post("http://"+e.addr+"/p", "text/plain", strings.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if !strings.HasSuffix(string(b), "body="+body) {
					t.Errorf("got %q for %s", b, body)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// TestH1DeadlinesKeptOnBusyConnections: the server keeps a read or write
// deadline an earlier request set while most of its timeout is left
// (instead of moving it per request); a connection busy for several
// timeouts must still be served throughout, and a request that outlives
// the deadline its head left behind must not be taken for a disconnect.
func TestH1DeadlinesKeptOnBusyConnections(t *testing.T) {
	const timeout = 400 * time.Millisecond
	t.Run("idle deadline moves on", func(t *testing.T) {
		e := newH1Env(t, h1Config{ReadHeaderTimeout: timeout / 2, IdleTimeout: timeout}, echo)
		c, br := e.dial()
		n := 0
		for start := time.Now(); time.Since(start) < 4*timeout; n++ {
			io.WriteString(c, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}")
			if got := readRaw(t, br, "POST"); got.status != 200 {
				t.Fatalf("request %d: status %d", n, got.status)
			}
		}
	})
	t.Run("write deadline moves on", func(t *testing.T) {
		const chunks = 40 // a tenth of the timeout apart: four timeouts
		e := newH1Env(t, h1Config{WriteTimeout: timeout}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			for range chunks {
				io.WriteString(w, "x")
				w.(http.Flusher).Flush()
				select {
				case <-time.After(timeout / 10):
				case <-r.Context().Done():
					return
				}
			}
		}))
		c, br := e.dial()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		if got := readRaw(t, br, "GET"); got.status != 200 || got.body != strings.Repeat("x", chunks) {
			t.Fatalf("got %d %q, want %d bytes", got.status, got.body, chunks)
		}
	})
	for _, split := range []bool{false, true} {
		t.Run(fmt.Sprintf("slow request, head split=%v", split), func(t *testing.T) {
			e := newH1Env(t, h1Config{ReadHeaderTimeout: timeout / 2, IdleTimeout: timeout, WatchDelay: time.Millisecond},
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					io.ReadAll(r.Body)
					select {
					case <-time.After(3 * timeout): // past the idle and header deadlines
						io.WriteString(w, "done")
					case <-r.Context().Done():
						http.Error(w, "canceled", 499)
					}
				}))
			c, br := e.dial()
			head := "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}"
			if split {
				// The second part arrives after the server read the first: the
				// head is read line by line, under the header timeout.
				io.WriteString(c, head[:10])
				waitFor(t, "the server to take the connection", func() bool { return e.activeConns() > 0 })
				head = head[10:]
			}
			io.WriteString(c, head)
			if got := readRaw(t, br, "POST"); got.status != 200 || got.body != "done" {
				t.Fatalf("got %d %q, want 200 done", got.status, got.body)
			}
		})
	}
}

// handoverListener is a ConnHandover that keeps a duplicate of each
// connection handed over, as systemd's file descriptor store would.
type handoverListener struct {
	net.Listener
	mu   sync.Mutex
	kept []net.Conn
}

func (l *handoverListener) HandOver(c net.Conn) error {
	f, err := c.(*net.TCPConn).File()
	if err != nil {
		return err
	}
	defer f.Close()
	d, err := net.FileConn(f)
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.kept = append(l.kept, d)
	l.mu.Unlock()
	return nil
}

func (l *handoverListener) taken() []net.Conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.kept
}

// oneConnListener accepts c once, then waits for Close.
type oneConnListener struct {
	c    net.Conn
	once sync.Once
	done chan struct{}
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	if c := l.c; c != nil {
		l.c = nil
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConnListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *oneConnListener) Addr() net.Addr { return &net.TCPAddr{} }

// activeConns counts the connections reading or serving a request.
func (e *h1Env) activeConns() int {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	n := 0
	for c := range e.srv.conns {
		if c.state.Load() == connActive {
			n++
		}
	}
	return n
}
