package proxy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// boundaryLengths are line lengths (CRLF included) around multiples of
// the 4 KiB read buffers, where a line arrives in fragments and its last
// fragment may be a bare "\n" or "\r\n".
func boundaryLengths() []int {
	var out []int
	for _, k := range []int{4096, 8192, 12288} {
		for d := -3; d <= 3; d++ {
			out = append(out, k+d)
		}
	}
	return out
}

// headerLine returns "<name>: xxx...\r\n" of exactly n bytes.
func headerLine(name string, n int) string {
	return name + ": " + strings.Repeat("x", n-len(name)-4) + "\r\n"
}

// TestH1HeadAtBufferBoundaries: a request whose request line or a header
// line ends at a read-buffer boundary is read whole, whatever the line's
// offset; a head ending early was answered 400 "truncated header".
func TestH1HeadAtBufferBoundaries(t *testing.T) {
	e := newH1Env(t, h1Config{}, echo)
	for _, n := range boundaryLengths() {
		long := headerLine("X-Test", n)
		value := long[len("X-Test: ") : len(long)-2]
		// The long line first after the request line, last, and as the
		// request line itself (a long query).
		target := "/q?" + strings.Repeat("a", n-len("POST /q? HTTP/1.1\r\n"))
		cases := map[string]string{
			"header first": "POST / HTTP/1.1\r\n" + long + "Host: h\r\nContent-Length: 2\r\n\r\n{}",
			"header last":  "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n" + long + "\r\n{}",
			"request line": "POST " + target + " HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
		}
		for name, req := range cases {
			c, br := e.dial()
			go io.WriteString(c, req)
			got := readRaw(t, br, "POST")
			if got.status != 200 || !strings.HasSuffix(got.body, "body={}") {
				t.Errorf("%s, line of %d bytes: %d %.80s, want 200 and the body", name, n, got.status, got.body)
				continue
			}
			if name != "request line" && !strings.Contains(got.body, strconv.Quote(value)) {
				t.Errorf("%s, line of %d bytes: the long header value did not arrive whole", name, n)
			}
			c.Close()
		}
	}
}

// TestH1RequestTrailerLines: trailer lines of any length within the head
// limit are accepted (they were refused past the 4 KiB buffer); more than
// the limit in all is refused.
func TestH1RequestTrailerLines(t *testing.T) {
	e := newH1Env(t, h1Config{}, echo)
	send := func(trailer string) rawResp {
		c, br := e.dial()
		defer c.Close()
		go io.WriteString(c, "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"+trailer+"\r\n")
		return readRaw(t, br, "POST")
	}
	for _, n := range boundaryLengths() {
		if got := send(headerLine("X-T", n)); got.status != 200 || !strings.HasSuffix(got.body, "body={}") {
			t.Errorf("trailer line of %d bytes: %d %.80s, want 200", n, got.status, got.body)
		}
	}
	if got := send(strings.Repeat(headerLine("X-T", 1000), 70)); got.status != 400 {
		t.Errorf("70 KB of trailer: %d, want 400", got.status)
	}
}

// TestResponseHeadAtBufferBoundaries: a response header line ending at a
// buffer boundary keeps the head whole; the rest of the head used to
// become the body (a shifted body, or a wait for the instance to close).
func TestResponseHeadAtBufferBoundaries(t *testing.T) {
	for _, n := range boundaryLengths() {
		long := headerLine("X-Long", n)
		for _, order := range []string{"length after", "length before"} {
			head := "HTTP/1.1 200 OK\r\n" + long + "Content-Length: 13\r\n\r\n"
			if order == "length before" {
				head = "HTTP/1.1 200 OK\r\nContent-Length: 13\r\n" + long + "\r\n"
			}
			br := bufio.NewReaderSize(strings.NewReader(head+`{"model":"m"}`), upReadBufSize)
			resp, err := readResponseHead(br)
			if err != nil {
				t.Errorf("%s, line of %d: %v", order, n, err)
				continue
			}
			rest, _ := io.ReadAll(br)
			if resp.ContentLength != 13 || len(resp.Header.Get("X-Long")) != n-len("X-Long: \r\n") || string(rest) != `{"model":"m"}` {
				t.Errorf("%s, line of %d: length %d, X-Long of %d bytes, body %.40q; want the head whole",
					order, n, resp.ContentLength, len(resp.Header.Get("X-Long")), rest)
			}
		}
	}
}

// TestUpstreamLongHeaderEndToEnd: through the proxy, a keep-alive instance
// whose answer has a header line at the buffer boundary gets its body
// rewritten, not hung on nor leaked.
func TestUpstreamLongHeaderEndToEnd(t *testing.T) {
	// Lines of 4097 and 4098 bytes leave "\n" and "\r\n" as the last
	// fragment of a 4 KiB buffer.
	for _, n := range []int{4097, 4098} {
		long := headerLine("X-Long", n)
		up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
			for u.read(br) {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"+long+"Content-Length: 13\r\n\r\n{\"model\":\"m\"}")
			}
		})
		e := newEnv(t, Config{UpstreamTimeout: 20 * time.Second})
		e.register(up.url(), "m")
		// The old failure was a hang: bound it.
		client := &http.Client{Timeout: 15 * time.Second}
		resp, err := client.Post(e.url+pathChat, "application/json", strings.NewReader(`{"model":"chat"}`))
		if err != nil {
			t.Fatalf("line of %d: %v", n, err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || string(got) != `{"model":"chat"}` {
			t.Errorf("line of %d: %d %q %v, want 200 {\"model\":\"chat\"}", n, resp.StatusCode, got, err)
		}
	}
}

// TestResponseHeadStrictness: header names are tokens, and obs-fold is
// refused, as in requests.
func TestResponseHeadStrictness(t *testing.T) {
	for name, head := range map[string]string{
		"space in name":      "HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
		"control in name":    "HTTP/1.1 200 OK\r\nBad\x01: x\r\n\r\n",
		"obs-fold":           "HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\n\r\n",
		"space before colon": "HTTP/1.1 200 OK\r\nContent-Length : 1\r\n\r\n",
		"signed length":      "HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n",
	} {
		if _, err := readResponseHead(bufio.NewReader(strings.NewReader(head))); err == nil {
			t.Errorf("%s: accepted %q", name, head)
		}
	}
}

// TestUpstreamResponseTrailerBounded: an instance's chunked trailer is
// read within the response head's limit, long lines included.
func TestUpstreamResponseTrailerBounded(t *testing.T) {
	for _, tt := range []struct {
		name    string
		trailer string
		ok      bool
	}{
		{"long line", headerLine("X-T", 8192), true},
		{"over the limit", strings.Repeat(headerLine("X-T", 1000), 1200), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
				if u.read(br) {
					io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"+tt.trailer+"\r\n")
				}
			})
			u := newUpstreamClient(time.Second, 10*time.Second, 4)
			defer u.closeIdle(true)
			resp, err := u.roundTrip(context.Background(), up.ln.Addr().String(), []byte("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"), false)
			if err != nil {
				t.Fatal(err)
			}
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			if (err == nil) != tt.ok {
				t.Errorf("reading the body: %v, want ok=%v", err, tt.ok)
			}
		})
	}
}

// Test413WithoutReset: a body over the limit is answered 413, and a client
// that sends its whole body before reading (as the SDKs do) reads the 413
// instead of a reset.
func Test413WithoutReset(t *testing.T) {
	// h1Server's lingering close; net/http's server resets such a client
	// (its test run with proxy.server std fails here: measured).
	e := newEnv(t, Config{MaxBodyBytes: 1 << 20, Server: ServerInfermesh})
	e.demo(0)
	const size = 48 << 20
	addr := strings.TrimPrefix(e.url, "http://")
	for i := range 3 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		wrote := make(chan error, 1)
		go func() {
			_, err := io.WriteString(c, fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", pathChat, addr, size))
			if err == nil {
				_, err = io.CopyN(c, zeroReader{}, size)
			}
			wrote <- err
		}()
		// The whole body goes out before the answer is read.
		if err := <-wrote; err != nil {
			t.Fatalf("try %d: sending the body: %v (the server reset the connection)", i, err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("try %d: reading the answer: %v", i, err)
		}
		if resp.StatusCode != http.StatusRequestEntityTooLarge || !resp.Close {
			t.Errorf("try %d: %d close=%v, want 413 and Connection: close", i, resp.StatusCode, resp.Close)
		}
		c.Close()
	}
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestUpstreamWrittenPostNotRetried: a POST written on a reused connection
// whose answer never comes is not sent again (the instance may be running
// it), unless the client marked it replayable: http.Transport's rule.
func TestUpstreamWrittenPostNotRetried(t *testing.T) {
	for _, tt := range []struct {
		name    string
		hdr     []string
		status  int
		reqs    int
		answers string
	}{
		{"not replayable", nil, http.StatusBadGateway, 2, ""},
		{"idempotency key", []string{"Idempotency-Key", "k1"}, http.StatusOK, 3, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			up := newRawUpstream(t, func(u *rawUpstream, c net.Conn, br *bufio.Reader) {
				if u.read(br) {
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"model\":\"m\"}")
				}
				u.read(br) // the second request is taken in, then the connection drops
			})
			e := newEnv(t, Config{})
			e.register(up.url(), "m")
			if resp := e.post(pathChat, `{"model":"chat"}`); resp.StatusCode != 200 {
				t.Fatalf("first request: %d", resp.StatusCode)
			} else {
				readAll(t, resp)
			}
			resp := e.post(pathChat, `{"model":"chat"}`, tt.hdr...)
			readAll(t, resp)
			up.mu.Lock()
			n := len(up.reqs)
			up.mu.Unlock()
			if resp.StatusCode != tt.status || n != tt.reqs {
				t.Errorf("second request: %d with %d requests at the instance, want %d with %d", resp.StatusCode, n, tt.status, tt.reqs)
			}
		})
	}
}

// TestSSELineTooLongCut: a data line over the relay's bound cannot be
// rewritten; the stream is cut with an error event and the instance's own
// model name never reaches the client.
func TestSSELineTooLongCut(t *testing.T) {
	pad := strings.Repeat("x", maxSSELine+(64<<10))
	e := newEnv(t, Config{})
	e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"model":"served-name","pad":"`+pad+`"}`+"\n\ndata: [DONE]\n\n")
	}), "served-name")
	resp := e.post(pathChat, `{"model":"chat","stream":true}`)
	got, _ := io.ReadAll(resp.Body) // the stream is cut: an error is expected
	if bytes.Contains(got, []byte("served-name")) {
		t.Error("the served model name leaked to the client")
	}
	if !bytes.Contains(got, []byte(`"code":"sse_line_too_long"`)) {
		t.Errorf("stream (%d bytes) does not end with the sse_line_too_long error event", len(got))
	}
}

// writeCounter records each Write a relay makes.
type writeCounter struct {
	*httptest.ResponseRecorder
	writes []string
}

func (w *writeCounter) Write(p []byte) (int, error) {
	w.writes = append(w.writes, string(p))
	return w.ResponseRecorder.Write(p)
}

// TestSSEOneEventOneWrite: a rewritten SSE event leaves the relay in one
// write (on the mesh each write is an HTTP/3 frame).
func TestSSEOneEventOneWrite(t *testing.T) {
	events := []string{
		`data: {"id":"1","model":"m","choices":[]}` + "\n\n",
		"event: ping\ndata: {\"model\":\"m\"}\nid: 7\n\n",
		`data: {"id":"2","model":"m","choices":[]}` + "\n\n",
		"data: [DONE]\n\n",
	}
	w := &writeCounter{ResponseRecorder: httptest.NewRecorder()}
	n, err := copySSE(w, http.NewResponseController(w), strings.NewReader(strings.Join(events, "")), []byte(`"chat"`), true)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.ReplaceAll(strings.Join(events, ""), `"m"`, `"chat"`)
	if got := w.Body.String(); got != want || n != int64(len(want)) {
		t.Fatalf("relayed %q (%d), want %q", got, n, want)
	}
	if len(w.writes) != len(events) {
		t.Errorf("%d writes for %d events: %q", len(w.writes), len(events), w.writes)
	}
}

// TestSSEPoolBufferIntact: the relay hands its buffer back whole, so a
// stream copy taking it next still reads (a zero-length buffer read
// nothing, forever).
func TestSSEPoolBufferIntact(t *testing.T) {
	for range 10 {
		w := httptest.NewRecorder()
		if _, err := copySSE(w, http.NewResponseController(w), strings.NewReader("data: {\"model\":\"m\"}\n\n"), []byte(`"c"`), true); err != nil {
			t.Fatal(err)
		}
		w2 := httptest.NewRecorder()
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = copyFlush(w2, http.NewResponseController(w2), strings.NewReader("abc"), true)
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("a stream copy after the SSE relay read nothing")
		}
		if w2.Body.String() != "abc" {
			t.Fatalf("copied %q, want abc", w2.Body.String())
		}
	}
}
