package proxy

import (
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
)

// h1Response is the http.ResponseWriter of h1Server, one per connection,
// reset for each request. It implements http.Flusher and FlushError, so
// http.ResponseController's Flush works.
//
// Framing is chosen when the head is written (at the first body byte past
// a small buffer, a flush, or the end of the handler): the handler's
// Content-Length when it set one; otherwise a response that ended within
// the buffer gets its length, and a longer one is chunked (HTTP/1.1) or
// ends with the connection (HTTP/1.0).
type h1Response struct {
	c   *h1Conn
	req *http.Request
	hdr http.Header

	status      int
	wroteHeader bool // the status is fixed
	committed   bool // the head is written (to the buffer)
	chunked     bool
	noBody      bool  // HEAD, 204, 304: body bytes are not sent
	cl          int64 // the Content-Length sent; -1 none
	written     int64 // body bytes accepted from the handler
	pending     []byte
	closeAfter  bool
	err         error // sticky write error
}

var (
	_ http.ResponseWriter             = (*h1Response)(nil)
	_ http.Flusher                    = (*h1Response)(nil)
	_ interface{ FlushError() error } = (*h1Response)(nil)
)

func (w *h1Response) reset(r *http.Request) {
	clear(w.hdr)
	*w = h1Response{c: w.c, req: r, hdr: w.hdr, cl: -1, pending: w.pending[:0]}
}

// Header returns the response header map; changes after the head was
// written have no effect.
func (w *h1Response) Header() http.Header { return w.hdr }

// WriteHeader fixes the status. Informational statuses (1xx) are sent at
// once and leave the final status to come.
func (w *h1Response) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if code < 200 && code != http.StatusSwitchingProtocols {
		if code == http.StatusContinue {
			if b := &w.c.body; b.expectContinue && !b.continueSent {
				b.continueSent = true
			} else {
				return
			}
		}
		b := w.appendHeaderFields(append(w.c.scratch[:0], statusLine(code)...), false)
		b = append(b, "\r\n"...)
		w.c.scratch = b[:0]
		w.write(b)
		if w.err == nil {
			w.err = w.c.bw.Flush()
		}
		return
	}
	w.wroteHeader = true
	w.status = code
}

func (w *h1Response) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if !w.committed {
		switch {
		case !bodyAllowed(w.status):
			return 0, http.ErrBodyNotAllowed
		case w.req.Method == http.MethodHead:
			w.written += int64(len(p))
			return len(p), nil
		case w.headerCL() < 0 && len(w.pending)+len(p) <= pendingSize:
			w.pending = append(w.pending, p...)
			w.written += int64(len(p))
			return len(p), nil
		}
		w.commit(false)
		if w.err != nil {
			return 0, w.err
		}
	}
	return w.writeBody(p)
}

func (w *h1Response) writeBody(p []byte) (int, error) {
	if w.noBody {
		if w.req.Method == http.MethodHead {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	if w.cl >= 0 && w.written+int64(len(p)) > w.cl {
		return 0, http.ErrContentLength
	}
	w.written += int64(len(p))
	if w.chunked {
		if len(w.pending)+len(p) <= pendingSize {
			w.pending = append(w.pending, p...)
			return len(p), nil
		}
		w.emitChunk(w.pending)
		w.pending = w.pending[:0]
		if len(p) >= pendingSize {
			w.emitChunk(p)
		} else {
			w.pending = append(w.pending, p...)
		}
		if w.err != nil {
			return 0, w.err
		}
		return len(p), nil
	}
	n, err := w.c.bw.Write(p)
	if err != nil {
		w.err = err
	}
	return n, err
}

// Flush sends what was written so far.
func (w *h1Response) Flush() { _ = w.FlushError() }

// FlushError sends what was written so far and reports a failure to.
func (w *h1Response) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.committed {
		w.commit(false)
	}
	if w.chunked && len(w.pending) > 0 {
		w.emitChunk(w.pending)
		w.pending = w.pending[:0]
	}
	if w.err != nil {
		return w.err
	}
	if err := w.c.bw.Flush(); err != nil {
		w.err = err
	}
	return w.err
}

// finish ends the response once the handler returned.
func (w *h1Response) finish() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.committed {
		w.commit(true)
	}
	if w.chunked {
		w.emitChunk(w.pending)
		w.pending = w.pending[:0]
		w.write([]byte("0\r\n\r\n"))
	} else if w.cl >= 0 && !w.noBody && w.written < w.cl {
		w.closeAfter = true // a short body: the connection cannot carry on
	}
	if w.err != nil {
		return w.err
	}
	if err := w.c.bw.Flush(); err != nil {
		w.err = err
	}
	if cap(w.pending) > 4*pendingSize {
		w.pending = nil
	}
	return w.err
}

func (w *h1Response) write(b []byte) {
	if w.err != nil {
		return
	}
	if _, err := w.c.bw.Write(b); err != nil {
		w.err = err
	}
}

func (w *h1Response) emitChunk(p []byte) {
	if len(p) == 0 || w.err != nil {
		return
	}
	b := strconv.AppendInt(w.c.scratch[:0], int64(len(p)), 16)
	b = append(b, "\r\n"...)
	w.c.scratch = b[:0]
	w.write(b)
	w.write(p)
	w.write([]byte("\r\n"))
}

// headerCL returns the Content-Length the handler set, or -1.
func (w *h1Response) headerCL() int64 {
	v := w.hdr["Content-Length"]
	if len(v) != 1 {
		return -1
	}
	n, ok := parseContentLength(trimOWS(v[0]))
	if !ok {
		return -1
	}
	return n
}

// bodyAllowed reports whether a response with status may have a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// commit chooses the framing and writes the head. final: the handler
// returned, so what is pending is the whole body.
func (w *h1Response) commit(final bool) {
	w.committed = true
	r := w.req
	c := w.c
	cl := w.headerCL()
	if cl >= 0 && cl < w.written {
		cl = -1 // more was written than declared: not a length to send
	}
	switch {
	case !bodyAllowed(w.status):
		w.noBody, cl = true, -1
	case r.Method == http.MethodHead:
		w.noBody = true
		if cl < 0 && final && w.written > 0 {
			cl = w.written
		}
	case cl >= 0:
	case final:
		cl = int64(len(w.pending))
	case r.ProtoMinor >= 1:
		w.chunked = true
	default:
		w.closeAfter = true // HTTP/1.0: the body ends with the connection
	}
	w.cl = cl
	if w.noBody {
		w.cl = -1 // nothing to count against
	}
	if r.Close || c.s.stopping.Load() || hasToken(headerValue(w.hdr, "Connection"), "close") {
		w.closeAfter = true
	}
	if b := &c.body; !b.done() && b.expectContinue && !b.continueSent {
		w.closeAfter = true // the client still waits to send a body
	}
	if b := &c.body; !b.done() && b.mode == framingLength && b.remain > maxDrainBody {
		w.closeAfter = true // too much left unread to drain and carry on
	}

	b := append(c.scratch[:0], statusLine(w.status)...)
	b = w.appendHeaderFields(b, true)
	if cl >= 0 {
		b = append(b, "Content-Length: "...)
		b = appendInt(b, cl)
		b = append(b, "\r\n"...)
	}
	if w.chunked {
		b = append(b, "Transfer-Encoding: chunked\r\n"...)
	}
	switch {
	case w.closeAfter:
		b = append(b, "Connection: close\r\n"...)
	case r.ProtoMinor == 0:
		b = append(b, "Connection: keep-alive\r\n"...)
	}
	b = append(b, "\r\n"...)
	c.scratch = b[:0]
	w.write(b)
	if !w.chunked && len(w.pending) > 0 {
		if !w.noBody {
			w.write(w.pending)
		}
		w.pending = w.pending[:0]
	}
}

// headerValue is h.Get(k) for a canonical k: the first value, or "".
// (Get canonicalizes its key on every call, a cost on the hot path.)
func headerValue(h http.Header, k string) string {
	if v := h[k]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// appendHeaderFields appends the handler's header fields, leaving out the
// framing and connection fields the server writes itself and any field
// that cannot be written as it is; withDate adds a Date unless the handler
// set one (or suppressed it with a nil value).
func (w *h1Response) appendHeaderFields(b []byte, withDate bool) []byte {
	hasDate := false
	for k, vv := range w.hdr {
		switch k {
		case "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "Te", "Trailer", "Upgrade", "Proxy-Connection":
			continue
		case "Date":
			hasDate = true
		}
		if !validToken(k) {
			continue
		}
		for _, v := range vv {
			b = append(b, k...)
			b = append(b, ": "...)
			b = appendFieldValue(b, v)
			b = append(b, "\r\n"...)
		}
	}
	if withDate && !hasDate {
		b = append(b, "Date: "...)
		b = appendDate(b)
		b = append(b, "\r\n"...)
	}
	return b
}

// appendFieldValue appends v with CR, LF and NUL turned into spaces, so a
// value can never end the header line early (as net/http does).
func appendFieldValue(b []byte, v string) []byte {
	if validValue(v) {
		return append(b, v...)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c == '\r' || c == '\n' || c == 0 {
			c = ' '
		}
		b = append(b, c)
	}
	return b
}

func appendInt(b []byte, n int64) []byte { return strconv.AppendInt(b, n, 10) }

// statusLines holds the status lines of the codes net/http names.
var statusLines = func() map[int]string {
	m := map[int]string{}
	for code := 100; code < 600; code++ {
		if t := http.StatusText(code); t != "" {
			m[code] = "HTTP/1.1 " + strconv.Itoa(code) + " " + t + "\r\n"
		}
	}
	return m
}()

var statusOK = statusLines[http.StatusOK]

func statusLine(code int) string {
	if code == http.StatusOK {
		return statusOK
	}
	if s, ok := statusLines[code]; ok {
		return s
	}
	return "HTTP/1.1 " + strconv.Itoa(code) + " status code " + strconv.Itoa(code) + "\r\n"
}

// The Date header value, formatted once a second.
type dateValue struct {
	sec int64
	b   []byte
}

var dateCache atomic.Pointer[dateValue]

func appendDate(b []byte) []byte {
	now := time.Now()
	sec := now.Unix()
	d := dateCache.Load()
	if d == nil || d.sec != sec {
		d = &dateValue{sec: sec, b: now.UTC().AppendFormat(make([]byte, 0, 29), http.TimeFormat)}
		dateCache.Store(d)
	}
	return append(b, d.b...)
}
