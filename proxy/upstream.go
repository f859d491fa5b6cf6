package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"
)

// upstreamClient is the HTTP/1.1 client of local instances. It replaces
// http.Transport on the hot path: the request (head and body) goes out in
// one write from the handler's goroutine, and the response is read there
// too, so a request costs no goroutine hand-offs (the transport's readLoop
// and writeLoop) and far fewer allocations, and an open stream holds one
// 4 KiB read buffer instead of two goroutines and 32 KiB of buffers.
//
// Semantics kept from the transport: keep-alive connections pooled per
// host (at most maxIdle idle each); a connect timeout; a timeout for the
// response head; the request context closing the connection when it ends
// (client disconnect reaches the instance). A pooled connection is checked
// before use (the instance may have closed it while idle: a peek without
// waiting sees the FIN) and replaced when closed. A request is sent again
// on a new connection only when it failed on a reused connection and
// either none of it was written, or it is replayable (the client sent an
// Idempotency-Key or X-Idempotency-Key): the rule of http.Transport. An
// inference request the instance may have received is never run twice.
//
// Safe for concurrent use.
type upstreamClient struct {
	dialer        net.Dialer
	headerTimeout time.Duration
	maxIdle       int
	idleTimeout   time.Duration

	mu     sync.Mutex
	idle   map[string][]*upConn // by host:port; most recently used last
	closed bool
}

// upConn is one connection to an instance.
type upConn struct {
	nc     net.Conn
	br     *bufio.Reader
	host   string
	idleAt time.Time
	// dl is the deadline set on nc (read and write); zero for none.
	dl time.Time
}

// upReadBufSize is the read buffer of an upstream connection: response
// heads and SSE events are small, and an open stream keeps it.
const upReadBufSize = 4 << 10

func newUpstreamClient(connectTimeout, headerTimeout time.Duration, maxIdle int) *upstreamClient {
	return &upstreamClient{
		dialer:        net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second},
		headerTimeout: headerTimeout,
		maxIdle:       maxIdle,
		idleTimeout:   90 * time.Second,
		idle:          map[string][]*upConn{},
	}
}

// get returns an idle connection to host, or dials one.
func (u *upstreamClient) get(ctx context.Context, host string, fresh bool) (uc *upConn, reused bool, err error) {
	if !fresh {
		now := time.Now()
		var stale []*upConn
		u.mu.Lock()
		list := u.idle[host]
		for len(list) > 0 {
			c := list[len(list)-1]
			list[len(list)-1] = nil
			list = list[:len(list)-1]
			if !c.dl.IsZero() && c.dl.Sub(now) < time.Second {
				// peerClosed cannot look past an expired deadline.
				_ = c.nc.SetDeadline(time.Time{})
				c.dl = time.Time{}
			}
			if now.Sub(c.idleAt) > u.idleTimeout || peerClosed(c.nc) {
				stale = append(stale, c)
				continue
			}
			uc = c
			break
		}
		u.idle[host] = list
		u.mu.Unlock()
		for _, c := range stale {
			c.nc.Close()
		}
		if uc != nil {
			return uc, true, nil
		}
	}
	nc, err := u.dialer.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, false, err
	}
	return &upConn{nc: nc, br: bufio.NewReaderSize(nc, upReadBufSize), host: host}, false, nil
}

// put returns a connection whose response was read to its end to the
// idle pool.
func (u *upstreamClient) put(uc *upConn) {
	if uc.br.Buffered() > 0 { // bytes beyond the response: not reusable
		uc.nc.Close()
		return
	}
	uc.idleAt = time.Now()
	u.mu.Lock()
	if u.closed || len(u.idle[uc.host]) >= u.maxIdle {
		u.mu.Unlock()
		uc.nc.Close()
		return
	}
	u.idle[uc.host] = append(u.idle[uc.host], uc)
	u.mu.Unlock()
}

// dropIdle closes every idle connection to host (the instance closed one
// while idle: it probably closed them all, e.g. on a restart).
func (u *upstreamClient) dropIdle(host string) {
	u.mu.Lock()
	list := u.idle[host]
	delete(u.idle, host)
	u.mu.Unlock()
	for _, c := range list {
		c.nc.Close()
	}
}

// closeIdle closes every idle connection; with final, later connections
// are closed instead of pooled.
func (u *upstreamClient) closeIdle(final bool) {
	u.mu.Lock()
	idle := u.idle
	u.idle = map[string][]*upConn{}
	if final {
		u.closed = true
	}
	u.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			c.nc.Close()
		}
	}
}

// errStaleConn marks a failure on a reused connection that allows sending
// the request again: nothing of it was written, or it is replayable and no
// byte of the response arrived.
var errStaleConn = errors.New("instance closed the idle connection")

// roundTrip sends req (a complete HTTP/1.1 request: head and body) to host
// and reads the response head. The response body reads from the
// connection; reading it to its end and closing it returns the connection
// to the pool. The body is not safe for concurrent use. replayable: the
// request may be sent twice (see the type's doc).
func (u *upstreamClient) roundTrip(ctx context.Context, host string, req []byte, replayable bool) (*http.Response, error) {
	fresh := false
	for {
		uc, reused, err := u.get(ctx, host, fresh)
		if err != nil {
			return nil, err
		}
		resp, err := u.exchange(ctx, uc, req, reused, replayable)
		if err == nil {
			return resp, nil
		}
		if errors.Is(err, errStaleConn) && ctx.Err() == nil && !fresh {
			u.dropIdle(host)
			fresh = true
			continue
		}
		return nil, err
	}
}

func (u *upstreamClient) exchange(ctx context.Context, uc *upConn, req []byte, reused, replayable bool) (*http.Response, error) {
	if err := ctx.Err(); err != nil {
		u.put(uc)
		return nil, err
	}
	// The request context ending (the client went away) closes the
	// connection, which ends any read or write on it.
	var stop func() bool
	if a, ok := ctx.(afterFuncer); ok {
		// The h1Server's request context: no child context, no
		// children map, no Done channel.
		stop = a.AfterFunc(func() { uc.nc.Close() })
	} else {
		stop = context.AfterFunc(ctx, func() { uc.nc.Close() })
	}
	fail := func(err error) (*http.Response, error) {
		stop()
		uc.nc.Close()
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, err
	}
	if d := u.headerTimeout; d > 0 {
		// A deadline an earlier exchange left with 7/8 of the timeout
		// to run is kept (see below): the bound is then 7/8 to all of
		// it, and a busy connection moves its timers once every d/8.
		if now := time.Now(); uc.dl.IsZero() || !deadlineFresh(uc.dl.Sub(now), d) {
			uc.dl = now.Add(d)
			_ = uc.nc.SetDeadline(uc.dl)
		}
	}
	if n, err := uc.nc.Write(req); err != nil {
		if reused && !isTimeout(err) && (n == 0 || replayable) {
			return fail(fmt.Errorf("%w: %w", errStaleConn, err))
		}
		return fail(err)
	}
	if _, err := uc.br.Peek(1); err != nil {
		if reused && replayable && !isTimeout(err) {
			return fail(fmt.Errorf("%w: %w", errStaleConn, err))
		}
		if isTimeout(err) {
			return fail(fmt.Errorf("timeout awaiting response headers: %w", err))
		}
		return fail(err)
	}
	resp, err := readResponseHead(uc.br)
	for err == nil && resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
		resp, err = readResponseHead(uc.br) // informational: the real answer follows
	}
	if err != nil {
		if isTimeout(err) {
			err = fmt.Errorf("timeout awaiting response headers: %w", err)
		}
		return fail(err)
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return fail(errors.New("instance switched protocols"))
	}
	if !uc.dl.IsZero() && !bodyBuffered(uc.br, resp) {
		// The body may take its time (a stream): no deadline. One
		// already read needs none cleared: nothing reads the connection
		// before the next exchange, and get clears one about to expire.
		_ = uc.nc.SetDeadline(time.Time{})
		uc.dl = time.Time{}
	}
	resp.Body = newUpBody(u, uc, resp, stop)
	return resp, nil
}

// newUpBody frames resp's body on uc (RFC 9112 section 6.3) and sets
// resp.ContentLength to match. stop ends the context watcher; it reports
// whether it was still armed.
func newUpBody(u *upstreamClient, uc *upConn, resp *http.Response, stop func() bool) *upBody {
	b := &upBody{u: u, uc: uc, stop: stop, keep: !resp.Close}
	switch {
	case resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified:
		resp.ContentLength = 0
		b.mode = framingLength
	case len(resp.TransferEncoding) > 0:
		resp.ContentLength = -1
		b.mode = framingChunked
		b.cr = httputil.NewChunkedReader(uc.br)
	case resp.ContentLength >= 0:
		b.mode, b.remain = framingLength, resp.ContentLength
	default:
		b.mode, b.keep = framingClose, false
		resp.Close = true // the body ends with the connection
	}
	if b.mode == framingLength && b.remain == 0 {
		b.finish()
	}
	return b
}

// bodyBuffered reports whether resp's whole body is in br already, so
// reading it cannot wait on the connection.
func bodyBuffered(br *bufio.Reader, resp *http.Response) bool {
	if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified {
		return true
	}
	return len(resp.TransferEncoding) == 0 && resp.ContentLength >= 0 && resp.ContentLength <= int64(br.Buffered())
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// upBody is a response body read straight from the connection. Not safe
// for concurrent use.
type upBody struct {
	u      *upstreamClient
	uc     *upConn
	stop   func() bool
	mode   framing
	remain int64
	cr     io.Reader
	keep   bool  // the connection may be reused once the body is read
	err    error // sticky: io.EOF once read to the end
}

func (b *upBody) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	var n int
	var err error
	switch b.mode {
	case framingLength:
		if int64(len(p)) > b.remain {
			p = p[:b.remain]
		}
		n, err = b.uc.br.Read(p)
		b.remain -= int64(n)
		if b.remain == 0 {
			b.finish()
			return n, io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
	case framingChunked:
		n, err = b.cr.Read(p)
		if err == io.EOF {
			if terr := readTrailerSection(b.uc.br, maxResponseHead); terr != nil {
				b.err = terr
				b.release(false)
				return n, terr
			}
			b.finish()
			return n, io.EOF
		}
	default:
		n, err = b.uc.br.Read(p)
		if err == io.EOF {
			b.err = io.EOF
			b.release(false)
			return n, io.EOF
		}
	}
	if err != nil {
		b.err = err
		b.release(false)
	}
	return n, err
}

// finish marks the body read to its end and hands the connection back.
func (b *upBody) finish() {
	b.err = io.EOF
	b.release(b.keep)
}

// release gives up the connection: back to the pool when reusable and the
// context watcher had not fired, closed otherwise.
func (b *upBody) release(reuse bool) {
	uc := b.uc
	if uc == nil {
		return
	}
	b.uc = nil
	if b.stop() && reuse {
		b.u.put(uc)
		return
	}
	uc.nc.Close()
}

// Close closes the connection unless the body was read to its end.
func (b *upBody) Close() error {
	if b.err == nil {
		b.err = errBodyClosed
	}
	b.release(false)
	return nil
}

var errBodyClosed = errors.New("read on closed response body")

// maxResponseHead bounds a response's status line and headers (and a
// chunked body's trailers): as the role ports bound a request's head, and
// the mesh a peer's response head (mesh.MaxHeadBytes). An instance's head
// is a few hundred bytes; one over the bound is answered 502.
const maxResponseHead = 64 << 10

// readResponseHead parses a status line and header block. Header keys are
// canonicalized; every value shares one string with the whole block, so a
// head costs a few allocations whatever its size.
func readResponseHead(br *bufio.Reader) (*http.Response, error) {
	// Small on purpose: a larger head goes to the heap. A peer's request
	// runs on a fresh goroutine per HTTP/3 stream, and a 2 KiB buffer here
	// made its stack grow twice, each time copying every frame below
	// (callgrind: about 60k instructions per remote request) and hold 64 KiB.
	var stack [512]byte
	block := stack[:0]
	var lines [16]int // end offsets of the lines in block
	nl := 0
	extra := []int(nil)
	for {
		// Only the whole line says whether it is the empty one: a line
		// longer than the buffer arrives in fragments, and its last may
		// be a bare "\n" or "\r\n".
		start := len(block)
		var err error
		block, err = appendLine(block, br, maxResponseHead)
		if err == errLineTooLong {
			return nil, errors.New("response head too large")
		}
		if err != nil {
			if err == io.EOF && len(block) > 0 {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		end := len(block)
		if nl < len(lines) {
			lines[nl] = end
		} else {
			extra = append(extra, end)
		}
		nl++
		if emptyLine(block[start:]) {
			break
		}
	}
	lineEnd := func(i int) int {
		if i < len(lines) {
			return lines[i]
		}
		return extra[i-len(lines)]
	}
	s := string(block) // one allocation for every key and value
	// trim drops a line end ("\n" or "\r\n", no more) and the optional
	// whitespace around s[a:b].
	trim := func(a, b int) (int, int) {
		if b > a && s[b-1] == '\n' {
			b--
			if b > a && s[b-1] == '\r' {
				b--
			}
		}
		for b > a && (s[b-1] == ' ' || s[b-1] == '\t') {
			b--
		}
		for a < b && (s[a] == ' ' || s[a] == '\t') {
			a++
		}
		return a, b
	}
	// Status line: HTTP/1.x SP 3DIGIT [SP reason]
	// The status line as it is, but for its line end (no trimming:
	// "200\r " is not a status code).
	st := strings.TrimSuffix(strings.TrimSuffix(s[:lineEnd(0)], "\n"), "\r")
	if len(st) < 12 || st[:7] != "HTTP/1." || st[7] < '0' || st[7] > '9' || st[8] != ' ' || (len(st) > 12 && st[12] != ' ') {
		return nil, fmt.Errorf("malformed response status line %q", st)
	}
	code, err := strconv.Atoi(st[9:12])
	if err != nil || code < 100 {
		return nil, fmt.Errorf("malformed response status line %q", st)
	}
	resp := &http.Response{
		Status:        st[9:],
		StatusCode:    code,
		Proto:         st[:8],
		ProtoMajor:    1,
		ProtoMinor:    int(st[7] - '0'),
		Header:        make(http.Header, nl),
		ContentLength: -1,
	}
	// One backing array for the single-valued headers.
	vals := make([]string, 0, nl)
	start := lineEnd(0)
	for i := 1; i < nl-1; i++ {
		end := lineEnd(i)
		if s[start] == ' ' || s[start] == '\t' {
			return nil, fmt.Errorf("obsolete line folding in the response header: %q", s[start:end])
		}
		ls, le := trim(start, end)
		start = end
		colon := -1
		for j := ls; j < le; j++ {
			if s[j] == ':' {
				colon = j
				break
			}
		}
		if colon <= ls || !validToken(s[ls:colon]) {
			return nil, fmt.Errorf("malformed response header line %q", s[ls:le])
		}
		key := canonicalKey(s[ls:colon]) // a valid token: as textproto.CanonicalMIMEHeaderKey
		va, vb := trim(colon+1, le)
		v := s[va:vb]
		if !validValue(v) {
			return nil, fmt.Errorf("invalid response header value of %s", key)
		}
		switch key {
		case "Content-Length":
			n, ok := parseContentLength(v)
			if !ok || (resp.ContentLength >= 0 && n != resp.ContentLength) {
				return nil, fmt.Errorf("bad Content-Length %q", v)
			}
			resp.ContentLength = n
		case "Transfer-Encoding":
			if resp.ProtoMinor == 0 {
				continue // HTTP/1.0 has no codings: the body ends at close (as net/http)
			}
			// Only "chunked", once, as http.ReadResponse: another coding
			// could only be relayed by reading until the instance closes.
			if resp.TransferEncoding != nil || !strings.EqualFold(v, "chunked") {
				return nil, fmt.Errorf("unsupported transfer encoding %q", v)
			}
			resp.TransferEncoding = chunkedTE
			continue // a hop-by-hop framing detail, as http.Transport does
		case "Connection":
			for _, f := range splitComma(v) {
				if asciiLower(f) == "close" {
					resp.Close = true
				}
			}
		}
		if old, ok := resp.Header[key]; ok {
			resp.Header[key] = append(old, v)
			continue
		}
		vals = append(vals, v)
		resp.Header[key] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	if resp.ProtoMinor == 0 {
		// HTTP/1.0 closes unless it says keep-alive.
		ka := false
		for _, f := range resp.Header["Connection"] {
			for _, g := range splitComma(f) {
				if asciiLower(g) == "keep-alive" {
					ka = true
				}
			}
		}
		resp.Close = resp.Close || !ka
	}
	return resp, nil
}

func splitComma(v string) []string {
	var out []string
	for len(v) > 0 {
		i := 0
		for i < len(v) && v[i] != ',' {
			i++
		}
		f := v[:i]
		for len(f) > 0 && (f[0] == ' ' || f[0] == '\t') {
			f = f[1:]
		}
		for len(f) > 0 && (f[len(f)-1] == ' ' || f[len(f)-1] == '\t') {
			f = f[:len(f)-1]
		}
		if f != "" {
			out = append(out, f)
		}
		if i == len(v) {
			break
		}
		v = v[i+1:]
	}
	return out
}

func asciiLower(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; 'A' <= c && c <= 'Z' {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if c := b[j]; 'A' <= c && c <= 'Z' {
					b[j] = c + 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return s
}
