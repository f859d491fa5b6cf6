package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"
)

// readRequest reads and parses the next request head into c.req and sets
// up its body. A nil *httpError with status 0 means: close without an
// answer (the client went away or timed out).
func (c *h1Conn) readRequest() (*http.Request, *httpError) {
	s, herr := c.readHead()
	if herr != nil {
		return nil, herr
	}
	return c.parseRequest(s)
}

var errClosed = &httpError{}

// readHead returns the request head (request line and header lines, up to
// and including the empty line) as one string, which every parsed field
// shares.
func (c *h1Conn) readHead() (string, *httpError) {
	max := c.s.cfg.MaxHeaderBytes
	// Fast path: the whole head is already buffered (a request arrives in
	// one segment): one copy, straight into the string.
	if n := c.br.Buffered(); n > 0 {
		buf, _ := c.br.Peek(n)
		skip := 0 // empty lines before a request are ignored (RFC 9112 2.2)
		for {
			if skip < len(buf) && buf[skip] == '\n' {
				skip++
			} else if skip+1 < len(buf) && buf[skip] == '\r' && buf[skip+1] == '\n' {
				skip += 2
			} else {
				break
			}
		}
		if end := headEnd(buf[skip:]); end > 0 {
			if end > max {
				return "", &httpError{status: http.StatusRequestHeaderFieldsTooLarge, msg: "request header fields too large"}
			}
			s := string(buf[skip : skip+end])
			_, _ = c.br.Discard(skip + end)
			return s, nil
		}
	}
	// Slow path: gather lines. The rest of the head has the header
	// timeout (its first byte arrived).
	c.idleUntil = time.Time{}
	_ = c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.ReadHeaderTimeout))
	head := c.head[:0]
	defer func() {
		if cap(head) <= 8<<10 {
			c.head = head[:0]
		}
	}()
	for {
		// A line longer than the read buffer arrives in fragments; only
		// the whole line (from start) says whether it is empty: a
		// fragment holding just "\n" or "\r\n" is the end of a long line.
		start := len(head)
		var err error
		head, err = appendLine(head, c.br, max)
		if err == errLineTooLong {
			return "", &httpError{status: http.StatusRequestHeaderFieldsTooLarge, msg: "request header fields too large"}
		}
		if err != nil {
			return "", errClosed // EOF, a reset or the read-header timeout
		}
		if emptyLine(head[start:]) {
			if start == 0 {
				head = head[:0]
				continue // empty lines before a request
			}
			// Empty lines before the request line were skipped: this one
			// ends the head.
			return string(head), nil
		}
	}
}

// errLineTooLong reports a head or trailer section over its size limit.
var errLineTooLong = errors.New("header section too large")

// appendLine appends the next line of br (through its newline, however
// many buffer fills it spans) to dst, refusing to let dst grow past max.
func appendLine(dst []byte, br *bufio.Reader, max int) ([]byte, error) {
	for {
		frag, err := br.ReadSlice('\n')
		dst = append(dst, frag...)
		if len(dst) > max {
			return dst, errLineTooLong
		}
		if err != bufio.ErrBufferFull {
			return dst, err
		}
	}
}

// emptyLine reports whether line (a whole line with its newline) is the
// empty line that ends a header or trailer section.
func emptyLine(line []byte) bool {
	return len(line) == 1 || (len(line) == 2 && line[0] == '\r')
}

// readTrailerSection consumes the trailer section after a chunked body's
// last chunk (httputil's chunked reader stops before it), discarding it,
// within limit bytes in all: the same bound as the head on that side.
// Its fields are checked as header fields are.
func readTrailerSection(br *bufio.Reader, limit int) error {
	var line []byte
	total := 0
	for {
		var err error
		line, err = appendLine(line[:0], br, limit-total)
		total += len(line)
		switch {
		case err == errLineTooLong:
			return errors.New("chunked trailer too large")
		case err == io.EOF:
			return io.ErrUnexpectedEOF
		case err != nil:
			return err
		case emptyLine(line):
			return nil
		}
		f := string(bytes.TrimRight(line, "\r\n"))
		name, value, ok := strings.Cut(f, ":")
		if !ok || !validToken(name) || !validValue(trimOWS(value)) {
			return errors.New("malformed chunked trailer field")
		}
	}
}

// headEnd returns the length of the head at the start of b (through the
// empty line ending it), or 0 when b does not hold a whole head.
func headEnd(b []byte) int {
	for i := 0; ; {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return 0
		}
		i += j + 1
		// An empty line: "\n" or "\r\n" right after the previous newline.
		if i < len(b) && b[i] == '\n' {
			return i + 1
		}
		if i+1 < len(b) && b[i] == '\r' && b[i+1] == '\n' {
			return i + 2
		}
	}
}

var chunkedTE = []string{"chunked"}

func badRequest(msg string) *httpError {
	return &httpError{status: http.StatusBadRequest, msg: msg}
}

// parseRequest parses head into c.req. Header keys are canonicalized and
// every value shares head's string; the header map and the value slices are
// the connection's, reused by the next request.
func (c *h1Conn) parseRequest(s string) (*http.Request, *httpError) {
	line, rest := nextLine(s)
	method, after, ok1 := strings.Cut(line, " ")
	target, proto, ok2 := strings.Cut(after, " ")
	if !ok1 || !ok2 || !validToken(method) {
		return nil, badRequest("malformed request line")
	}
	if target == "" {
		return nil, badRequest("empty request target")
	}
	if !validTarget(target) {
		return nil, badRequest("control, space or non-ASCII byte in the request target")
	}
	var minor int
	switch {
	case len(proto) == 8 && proto[:7] == "HTTP/1." && '0' <= proto[7] && proto[7] <= '9':
		minor = int(proto[7] - '0')
		if minor > 1 {
			minor = 1
		}
	case len(proto) == 8 && proto[:5] == "HTTP/" && '0' <= proto[5] && proto[5] <= '9' && proto[6] == '.' && '0' <= proto[7] && proto[7] <= '9':
		return nil, &httpError{status: http.StatusHTTPVersionNotSupported, msg: "unsupported HTTP version " + proto}
	default:
		return nil, badRequest("malformed HTTP version")
	}

	clear(c.hdr)
	h := c.hdr
	vals := c.vals[:0]
	var host string
	hosts := 0
	var cl int64 = -1
	chunked, haveTE := false, false
	closeConn, keepAlive := false, false
	expect := ""
	for {
		if rest == "" {
			return nil, badRequest("truncated header")
		}
		line, rest = nextLine(rest)
		if line == "" {
			break
		}
		if line[0] == ' ' || line[0] == '\t' {
			return nil, badRequest("obsolete line folding in the header")
		}
		colon := strings.IndexByte(line, ':')
		if colon <= 0 || !validToken(line[:colon]) {
			return nil, badRequest("malformed header line")
		}
		key := canonicalKey(line[:colon])
		v := trimOWS(line[colon+1:])
		if !validValue(v) {
			return nil, badRequest("invalid header value of " + key)
		}
		switch key {
		case "Host":
			hosts++
			host = v
			continue // net/http keeps Host out of the header map too
		case "Content-Length":
			n, ok := parseContentLength(v)
			if !ok || (cl >= 0 && n != cl) {
				return nil, badRequest("bad Content-Length")
			}
			cl = n
		case "Transfer-Encoding":
			if minor == 0 {
				// RFC 9112 6.1: a coding HTTP/1.0 does not know
				// (net/http ignores it; the body's end is then unclear).
				return nil, badRequest("Transfer-Encoding in an HTTP/1.0 request")
			}
			if haveTE {
				return nil, &httpError{status: http.StatusNotImplemented, msg: "unsupported transfer encoding"}
			}
			haveTE = true
			if !strings.EqualFold(v, "chunked") {
				return nil, &httpError{status: http.StatusNotImplemented, msg: "unsupported transfer encoding"}
			}
			chunked = true
		case "Connection":
			closeConn = closeConn || hasToken(v, "close")
			keepAlive = keepAlive || hasToken(v, "keep-alive")
		case "Expect":
			expect = v
		}
		if old, ok := h[key]; ok {
			h[key] = append(old, v)
			continue
		}
		vals = append(vals, v)
		h[key] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	if cap(vals) <= 256 {
		c.vals = vals[:0]
	}
	if rest != "" {
		return nil, badRequest("bytes after the header")
	}

	r := &c.req
	*r = http.Request{
		Method:     method,
		Proto:      "HTTP/1.1",
		ProtoMajor: 1,
		ProtoMinor: minor,
		Header:     h,
		RequestURI: target,
		RemoteAddr: c.remoteAddr,
	}
	if minor == 0 {
		r.Proto = "HTTP/1.0"
	}
	if err := c.parseTarget(r, target); err != nil {
		return nil, badRequest("malformed request target")
	}
	switch {
	case hosts > 1:
		return nil, badRequest("more than one Host header")
	case hosts == 0 && minor >= 1 && method != http.MethodConnect:
		return nil, badRequest("missing Host header")
	case !validHost(host):
		return nil, badRequest("malformed Host header")
	}
	r.Host = host
	if r.URL.Host != "" {
		r.Host = r.URL.Host
	}
	r.Close = closeConn || (minor == 0 && !keepAlive)

	b := &c.body
	b.reset()
	switch {
	case chunked && cl >= 0:
		return nil, badRequest("both Content-Length and Transfer-Encoding")
	case chunked && minor == 0:
		return nil, badRequest("Transfer-Encoding in an HTTP/1.0 request")
	case chunked:
		b.mode = framingChunked
		b.cr = httputil.NewChunkedReader(c.br)
		r.ContentLength = -1
		r.TransferEncoding = chunkedTE
		r.Body = b
	case cl > 0:
		b.mode = framingLength
		b.remain = cl
		r.ContentLength = cl
		r.Body = b
	default:
		b.mode = framingNone
		r.Body = http.NoBody
	}
	if expect != "" {
		if !strings.EqualFold(expect, "100-continue") {
			return nil, &httpError{status: http.StatusExpectationFailed, msg: "unsupported expectation"}
		}
		b.expectContinue = minor >= 1 && b.mode != framingNone
	}
	return r, nil
}

// parseTarget fills r.URL from the request target. Origin-form targets
// without escapes (every request the proxy serves) are split by hand into
// the connection's URL; the rest go through net/url.
func (c *h1Conn) parseTarget(r *http.Request, target string) error {
	if target[0] == '/' && strings.IndexByte(target, '%') < 0 {
		c.url = url.URL{}
		path, query, hasQ := strings.Cut(target, "?")
		c.url.Path = path
		c.url.RawQuery = query
		c.url.ForceQuery = hasQ && query == ""
		r.URL = &c.url
		return nil
	}
	if target == "*" {
		c.url = url.URL{Path: "*"}
		r.URL = &c.url
		return nil
	}
	if r.Method == http.MethodConnect && target[0] != '/' {
		// authority-form, read as net/http reads it (a URL of scheme
		// http, the scheme then dropped), so what it refuses is refused.
		u, err := url.ParseRequestURI("http://" + target)
		if err != nil {
			return err
		}
		u.Scheme = ""
		r.URL = u
		return nil
	}
	u, err := url.ParseRequestURI(target)
	if err != nil {
		return err
	}
	r.URL = u
	return nil
}

// nextLine splits s at its first newline, dropping a CR before it.
func nextLine(s string) (line, rest string) {
	i := strings.IndexByte(s, '\n')
	if i < 0 {
		return s, ""
	}
	line, rest = s[:i], s[i+1:]
	if len(line) > 0 && line[len(line)-1] == '\r' {
		line = line[:len(line)-1]
	}
	return line, rest
}

func trimOWS(v string) string {
	for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
		v = v[1:]
	}
	for len(v) > 0 && (v[len(v)-1] == ' ' || v[len(v)-1] == '\t') {
		v = v[:len(v)-1]
	}
	return v
}

// tokenChars are the bytes of an RFC 9110 token (method, header name).
var tokenChars = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-'a'+'A'] = true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()

func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !tokenChars[s[i]] {
			return false
		}
	}
	return true
}

// validValue reports whether v is a valid field value: no control
// characters but tab (obs-text is allowed).
func validValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// validTarget refuses control characters, spaces and non-ASCII bytes in
// the request target.
func validTarget(t string) bool {
	for i := 0; i < len(t); i++ {
		if c := t[i]; c <= 0x20 || c >= 0x7f {
			return false
		}
	}
	return true
}

// validHost accepts the bytes a Host header may carry (as net/http's
// httpguts.ValidHostHeader does).
func validHost(h string) bool {
	for i := 0; i < len(h); i++ {
		c := h[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!$%&'()*+,-.:;=[]_~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// parseContentLength parses a Content-Length value: digits only (leading
// zeros allowed, as net/http reads them), at most 2^63-1.
func parseContentLength(v string) (int64, bool) {
	if v == "" {
		return 0, false
	}
	var n int64
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' || n > (math.MaxInt64-9)/10 {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// hasToken reports whether the comma-separated list v holds tok
// (case-insensitively), without allocating.
func hasToken(v, tok string) bool {
	for v != "" {
		f, rest, _ := strings.Cut(v, ",")
		if strings.EqualFold(trimOWS(f), tok) {
			return true
		}
		v = rest
	}
	return false
}

// commonKeys maps the canonical form of frequent header names to a shared
// string, so canonicalizing "content-type" costs no allocation.
var commonKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{
		"Accept", "Accept-Encoding", "Accept-Language", "Authorization", "Cache-Control",
		"Connection", "Content-Length", "Content-Type", "Cookie", "Expect", "Host",
		"Keep-Alive", "Origin", "Referer", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
		"User-Agent", "X-Forwarded-For", "X-Request-Id", "Openai-Organization", "Openai-Project",
		"Openai-Beta", "X-Stainless-Arch", "X-Stainless-Lang", "X-Stainless-Os",
		"X-Stainless-Package-Version", "X-Stainless-Runtime", "X-Stainless-Runtime-Version",
		"X-Stainless-Retry-Count", "X-Stainless-Read-Timeout", "X-Stainless-Timeout",
		"X-Stainless-Async", "X-Stainless-Helper-Method", "Idempotency-Key", "Infermesh-Role",
		"Sec-Fetch-Mode", "Sec-Fetch-Site", "Sec-Fetch-Dest", "Priority",
	} {
		m[k] = k
	}
	return m
}()

// canonicalKey returns the canonical form of the valid token k (as
// textproto.CanonicalMIMEHeaderKey); an already canonical k is returned as
// is.
func canonicalKey(k string) string {
	upper := true
	canonical := true
	for i := 0; i < len(k); i++ {
		c := k[i]
		if upper && 'a' <= c && c <= 'z' || !upper && 'A' <= c && c <= 'Z' {
			canonical = false
			break
		}
		upper = c == '-'
	}
	if canonical {
		return k
	}
	var stack [64]byte
	var b []byte
	if len(k) <= len(stack) {
		b = stack[:len(k)]
	} else {
		b = make([]byte, len(k))
	}
	upper = true
	for i := 0; i < len(k); i++ {
		c := k[i]
		switch {
		case upper && 'a' <= c && c <= 'z':
			c -= 'a' - 'A'
		case !upper && 'A' <= c && c <= 'Z':
			c += 'a' - 'A'
		}
		b[i] = c
		upper = c == '-'
	}
	if v, ok := commonKeys[string(b)]; ok {
		return v
	}
	return string(b)
}

// framing is how a message body is delimited on the wire (RFC 9112
// section 6), for requests and responses alike.
type framing uint8

const (
	framingNone    framing = iota // no body
	framingLength                 // Content-Length bytes
	framingChunked                // chunked transfer coding
	framingClose                  // until the peer closes (responses only)
)

// h1Body is a request body read from the connection. Not safe for
// concurrent use.
type h1Body struct {
	c              *h1Conn
	mode           framing
	remain         int64
	cr             io.Reader
	err            error // sticky: io.EOF once read to the end
	closed         bool
	expectContinue bool
	continueSent   bool
	deadline       bool // serveRequest set the body's read deadline
}

// buffered reports whether reading the body cannot wait on the
// connection: there is none, or all of it is in the read buffer.
func (b *h1Body) buffered() bool {
	switch b.mode {
	case framingNone:
		return true
	case framingLength:
		return b.remain <= int64(b.c.br.Buffered())
	}
	return false
}

func (b *h1Body) reset() {
	*b = h1Body{c: b.c}
}

var errBodyReadAfterClose = errors.New("http: invalid Read on closed Body")

func (b *h1Body) Read(p []byte) (int, error) {
	if b.closed {
		return 0, errBodyReadAfterClose
	}
	if b.err != nil {
		return 0, b.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if b.expectContinue && !b.continueSent {
		b.continueSent = true
		if !b.c.resp.committed {
			_, _ = b.c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
			if err := b.c.bw.Flush(); err != nil {
				b.err = err
				return 0, err
			}
		}
	}
	var n int
	var err error
	switch b.mode {
	case framingLength:
		if int64(len(p)) > b.remain {
			p = p[:b.remain]
		}
		n, err = b.c.br.Read(p)
		b.remain -= int64(n)
		if b.remain == 0 {
			b.err = io.EOF
			b.c.bodyFinished()
			return n, io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
	case framingChunked:
		n, err = b.cr.Read(p)
		if err == io.EOF {
			if terr := b.readTrailer(); terr != nil {
				b.err = terr
				return n, terr
			}
			b.err = io.EOF
			b.c.bodyFinished()
			return n, io.EOF
		}
	default:
		b.err = io.EOF
		return 0, io.EOF
	}
	if err != nil {
		b.err = err
	}
	return n, err
}

// readTrailer consumes the trailer section of a chunked body (discarded:
// the proxy forwards no request trailers), within the header size limit.
func (b *h1Body) readTrailer() error {
	return readTrailerSection(b.c.br, b.c.s.cfg.MaxHeaderBytes)
}

// Close marks the body closed; what is left is drained (or the connection
// closed) once the handler returns.
func (b *h1Body) Close() error {
	b.closed = true
	return nil
}

// done reports whether the body was read to its end (or there was none).
func (b *h1Body) done() bool {
	return b.mode == framingNone || b.err == io.EOF
}

// drain reads and discards what the handler left of the body, up to
// maxDrainBody; it reports whether the connection can be reused.
func (b *h1Body) drain() bool {
	if b.err != nil && b.err != io.EOF {
		return false
	}
	if b.mode == framingLength && b.remain > maxDrainBody {
		return false
	}
	b.closed = false
	var buf [512]byte
	total := 0
	for total <= maxDrainBody {
		n, err := b.Read(buf[:])
		total += n
		if err == io.EOF {
			return true
		}
		if err != nil {
			return false
		}
	}
	return false
}
