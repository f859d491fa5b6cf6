package proxy

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

// The differential fuzzers feed the same bytes to infermesh's HTTP/1.1
// parsers and to net/http's (http.ReadRequest, http.ReadResponse), through
// read buffers of 16 to 64 bytes so that every line crosses buffer
// boundaries somewhere (net/http, the oracle, reads through its usual 4 KiB
// buffer: its chunked trailer check fails on small ones). What infermesh accepts, net/http must accept too,
// and read the same way: the same method, target, headers, framing and
// body, and the same bytes left over for the next message (a disagreement
// there is request smuggling). infermesh refusing what net/http accepts is
// a finding too, except for the strictness listed in
// requestStrictness/responseStrictness, which is on purpose.

// requestStrictness lists, by the error message infermesh answers with,
// what it refuses although http.ReadRequest reads it. Each is refused by
// net/http's server too (after ReadRequest) or by RFC 9112.
var requestStrictness = []string{
	// RFC 9112 6.1: a request with both is a smuggling attempt; net/http
	// reads it with Content-Length ignored.
	"both Content-Length and Transfer-Encoding",
	// RFC 9112 6.1: chunked is not HTTP/1.0; net/http reads it.
	"Transfer-Encoding in an HTTP/1.0 request",
	// RFC 9112 5.2: obs-fold may be refused; net/http joins the lines.
	"obsolete line folding",
	// net/http's server refuses these after ReadRequest (400, 417, 505).
	"missing Host header", "more than one Host header", "malformed Host header",
	"unsupported expectation", "unsupported HTTP version",
	// Control characters in field values (RFC 9110 5.5): net/http's
	// server refuses them as well; ReadRequest passes them.
	"invalid header value",
	// A field name that is not a token (RFC 9110 5.1): ReadRequest keeps
	// it, net/http's server refuses it.
	"malformed header line",
	// RFC 3986: bytes outside printable ASCII are percent-encoded in a
	// request target; net/http passes them.
	"non-ASCII byte in the request target",
	// RFC 9112 3.2: the request target is not empty; ReadRequest reads
	// an empty one as a CONNECT authority.
	"empty request target",
	// The head limit (431): ReadRequest has none.
	"request header fields too large",
}

// responseStrictness is the same for responses (http.ReadResponse).
var responseStrictness = []string{
	// RFC 9112 5.2: obs-fold may be refused; net/http joins the lines.
	"obsolete line folding",
	// A field name that is not a token (RFC 9110 5.1): ReadResponse keeps
	// it, and it could only be relayed as garbage.
	"malformed response header line",
	// 1xx, 204 and 304 answers are told apart before any body is read.
	"malformed response status line",
}

func strictOnPurpose(list []string, msg string) bool {
	for _, s := range list {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// framingFree returns h without what only frames the message (compared
// on their own: ContentLength, TransferEncoding, Close), and with equal
// repeated Content-Length values (which net/http collapses) as one.
func framingFree(h http.Header) map[string][]string {
	out := map[string][]string{}
	for k, vv := range h {
		switch k {
		case "Transfer-Encoding", "Connection":
			continue
		case "Content-Length":
			vv = vv[:1]
		}
		out[k] = vv
	}
	return out
}

// bareLFTrailer tells net/http's one quirk apart: it finds the end of a
// chunked body's trailer by looking for CRLF CRLF (peeking two bytes for
// the first), so a trailer ended by bare LFs fails there ("unexpected EOF
// reading trailer", "suspiciously long trailer"). RFC 9112 2.2 lets a
// recipient take a bare LF as a line end, as infermesh does in heads.
func bareLFTrailer(err, refErr error, data []byte) bool {
	return err == nil && refErr != nil && strings.Contains(refErr.Error(), "trailer") &&
		bytes.Count(data, []byte("\n")) > bytes.Count(data, []byte("\r\n"))
}

// nopNetConn stands for a connection a parser only sets deadlines on.
type nopNetConn struct{ net.Conn }

func (nopNetConn) SetReadDeadline(time.Time) error { return nil }

var fuzzBufSizes = []int{16, 17, 31, 64}

// newFuzzConn returns a connection reading data through a buffer of size
// bytes (the server's parser with nothing on the wire).
func newFuzzConn(data []byte, size int) *h1Conn {
	s := newH1Server(nil, h1Config{MaxHeaderBytes: 64 << 10})
	c := &h1Conn{
		s:          s,
		nc:         nopNetConn{},
		br:         bufio.NewReaderSize(bytes.NewReader(data), size),
		bw:         bufio.NewWriter(io.Discard),
		remoteAddr: "127.0.0.1:1",
		hdr:        map[string][]string{},
	}
	c.body.c = c
	c.resp.c = c
	return c
}

func FuzzH1RequestVsNetHTTP(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
		"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\ncontent-type: application/json\r\nContent-Length: 2\r\n\r\n{}",
		"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: 1\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
		"GET http://localhost/p HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
		"OPTIONS * HTTP/1.1\nHost: h\n\n",
		"GET /%41%zz HTTP/1.1\r\nHost: h\r\n\r\n",
		"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabcGET / HTTP/1.1\r\nHost: h\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nX-Long: " + strings.Repeat("v", 70) + "\r\nCookie: a=b\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 8<<10 {
			return
		}
		for _, size := range fuzzBufSizes {
			diffRequest(t, data, size)
		}
	})
}

func diffRequest(t *testing.T, data []byte, size int) {
	c := newFuzzConn(data, size)
	r, herr := c.readRequest()
	// Empty lines before a request are ignored on purpose (RFC 9112 2.2);
	// http.ReadRequest reads from the request line on.
	lead := data
	for len(lead) > 0 && (lead[0] == '\n' || bytes.HasPrefix(lead, []byte("\r\n"))) {
		if lead[0] == '\n' {
			lead = lead[1:]
		} else {
			lead = lead[2:]
		}
	}
	refBR := bufio.NewReader(bytes.NewReader(lead)) // the oracle, at its usual size
	ref, refErr := http.ReadRequest(refBR)
	if herr != nil {
		if herr.status != 0 && (herr.status < 400 || herr.status > 599) {
			t.Fatalf("error status %d", herr.status)
		}
		if refErr == nil && herr.status != 0 && !strictOnPurpose(requestStrictness, herr.msg) {
			t.Fatalf("buffer %d: refused %q (%d %s); net/http reads it", size, data, herr.status, herr.msg)
		}
		return
	}
	if refErr != nil {
		t.Fatalf("buffer %d: accepted %q; net/http refuses it: %v", size, data, refErr)
	}
	got := []any{r.Method, r.RequestURI, r.ProtoMinor, r.Host, r.ContentLength, r.TransferEncoding, r.Close}
	// HTTP/1.2 and later minors are read as 1.1, the version infermesh
	// answers in (RFC 9110 2.5: a recipient may treat a higher minor as
	// its own); net/http keeps the number.
	want := []any{ref.Method, ref.RequestURI, min(ref.ProtoMinor, 1), ref.Host, ref.ContentLength, ref.TransferEncoding, ref.Close}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("buffer %d, %q:\n got %v\nwant %v", size, data, got, want)
	}
	if !reflect.DeepEqual(framingFree(r.Header), framingFree(ref.Header)) {
		t.Fatalf("buffer %d, %q: header\n got %v\nwant %v", size, data, r.Header, ref.Header)
	}
	if r.URL.Path != ref.URL.Path || r.URL.RawQuery != ref.URL.RawQuery || r.URL.Host != ref.URL.Host {
		t.Fatalf("buffer %d, %q: URL %#v, want %#v", size, data, r.URL, ref.URL)
	}
	body, err := io.ReadAll(r.Body)
	refBody, refErr := io.ReadAll(ref.Body)
	if bareLFTrailer(err, refErr, data) {
		return
	}
	if (err == nil) != (refErr == nil) || !bytes.Equal(body, refBody) {
		t.Fatalf("buffer %d, %q: body %q (%v), want %q (%v)", size, data, body, err, refBody, refErr)
	}
	if err != nil {
		return
	}
	// The same bytes are left for the next request.
	rest, _ := io.ReadAll(c.br)
	refRest, _ := io.ReadAll(refBR)
	if !bytes.Equal(rest, refRest) {
		t.Fatalf("buffer %d, %q: left %q for the next request, net/http %q", size, data, rest, refRest)
	}
}

func FuzzResponseVsNetHTTP(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"model\":\"m\"}",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n1a\r\ndata: {\"model\":\"m\"}\n\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\n\r\n",
		"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 8<<10 {
			return
		}
		for _, size := range fuzzBufSizes {
			diffResponse(t, data, size)
		}
	})
}

func diffResponse(t *testing.T, data []byte, size int) {
	br := bufio.NewReaderSize(bytes.NewReader(data), size)
	resp, err := readResponseHead(br)
	// Empty lines before a request are ignored on purpose (RFC 9112 2.2);
	// http.ReadRequest reads from the request line on.
	lead := data
	for len(lead) > 0 && (lead[0] == '\n' || bytes.HasPrefix(lead, []byte("\r\n"))) {
		if lead[0] == '\n' {
			lead = lead[1:]
		} else {
			lead = lead[2:]
		}
	}
	refBR := bufio.NewReader(bytes.NewReader(lead)) // the oracle, at its usual size
	ref, refErr := http.ReadResponse(refBR, &http.Request{Method: http.MethodPost})
	if err == nil && (resp.StatusCode < 200 || resp.StatusCode > 999) {
		// Informational answers are read again by the client; a status
		// over 999 is not one net/http reads either.
		return
	}
	if err != nil {
		if refErr == nil && err != io.EOF && !strictOnPurpose(responseStrictness, err.Error()) {
			t.Fatalf("buffer %d: refused %q (%v); net/http reads it", size, data, err)
		}
		return
	}
	if refErr != nil {
		t.Fatalf("buffer %d: accepted %q; net/http refuses it: %v", size, data, refErr)
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	u := &upstreamClient{idle: map[string][]*upConn{}}
	resp.Body = newUpBody(u, &upConn{nc: a, br: br}, resp, func() bool { return false })
	// The reason phrase is not compared: the proxy never relays it.
	got := []any{resp.StatusCode, resp.ProtoMinor, resp.ContentLength, resp.TransferEncoding, resp.Close}
	want := []any{ref.StatusCode, ref.ProtoMinor, ref.ContentLength, ref.TransferEncoding, ref.Close}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("buffer %d, %q:\n got %v\nwant %v", size, data, got, want)
	}
	if !reflect.DeepEqual(framingFree(resp.Header), framingFree(ref.Header)) {
		t.Fatalf("buffer %d, %q: header\n got %v\nwant %v", size, data, resp.Header, ref.Header)
	}
	body, err := io.ReadAll(resp.Body)
	refBody, refErr := io.ReadAll(ref.Body)
	if bareLFTrailer(err, refErr, data) {
		return
	}
	if (err == nil) != (refErr == nil) || !bytes.Equal(body, refBody) {
		t.Fatalf("buffer %d, %q: body %q (%v), want %q (%v)", size, data, body, err, refBody, refErr)
	}
	if err != nil {
		return
	}
	rest, _ := io.ReadAll(br)
	refRest, _ := io.ReadAll(refBR)
	if !bytes.Equal(rest, refRest) {
		t.Fatalf("buffer %d, %q: left %q for the next response, net/http %q", size, data, rest, refRest)
	}
}
