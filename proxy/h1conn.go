package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Connection states.
const (
	connIdle     = iota // waiting for a request (closeable by Shutdown)
	connActive          // reading or serving a request
	connClosed          // closed by Shutdown or Close
	connLinger          // answered, closing: reading what the client still sends (Shutdown closes it at once)
	connHandover        // idle, being handed over by Shutdown (ConnHandover)
)

const (
	connReadBufSize  = 4 << 10
	connWriteBufSize = 4 << 10
	// pendingSize buffers a response of unknown length: one that ends
	// within it gets a Content-Length, a longer one is sent in chunks of
	// about this size (flushes send what is there).
	pendingSize = 2 << 10
	// maxDrainBody is how much of a request body the handler left unread
	// is read and discarded to keep the connection.
	maxDrainBody = 256 << 10
	// lingerTimeout and maxLingerBytes bound the reading of what a
	// client still sends after its request was answered without being
	// read (a 413, a malformed request), before the connection closes.
	lingerTimeout  = 5 * time.Second
	maxLingerBytes = 128 << 20
)

// h1Conn is one client connection. Its fields are owned by its serve
// goroutine, except those under wmu and the atomics.
type h1Conn struct {
	s          *h1Server
	nc         net.Conn
	br         *bufio.Reader
	bw         *bufio.Writer
	state      atomic.Int32
	inBody     atomic.Bool // the handler may be waiting for request body bytes
	inHead     atomic.Bool // reading a request head; cleared under wmu
	graced     atomic.Bool // Shutdown moved the write deadline to graceEnd
	remoteAddr string

	// Per request, reused.
	req     http.Request
	url     url.URL
	hdr     http.Header
	vals    []string // backing store of single header values
	head    []byte   // a request head that did not fit the read buffer
	body    h1Body
	resp    h1Response
	scratch []byte // response heads and chunk sizes

	// idleUntil is the read deadline serve last set for the wait between
	// requests; zero when another deadline may have replaced it since.
	// Owned by the serve goroutine.
	idleUntil time.Time

	// Disconnect watching, under wmu.
	wmu         sync.Mutex
	cancel      *reqCtx       // the current request's context; nil between requests
	bodyDone    bool          // the request body was read to its end
	watchWanted bool          // watchDelay passed before bodyDone
	watchDone   chan struct{} // non-nil while a watcher runs
	gone        bool          // the watcher saw the client go away
	stopWatch   atomic.Bool
	timer       *time.Timer
}

func newH1Conn(s *h1Server, nc net.Conn) *h1Conn {
	c := &h1Conn{
		s:          s,
		nc:         nc,
		br:         bufio.NewReaderSize(nc, connReadBufSize),
		bw:         bufio.NewWriterSize(&deadlineConn{Conn: nc, d: s.cfg.WriteTimeout, stop: &s.stopping}, connWriteBufSize),
		remoteAddr: nc.RemoteAddr().String(),
		hdr:        make(http.Header, 16),
		vals:       make([]string, 0, 16),
	}
	c.body.c = c
	c.resp.c = c
	c.resp.hdr = make(http.Header, 8)
	if s.cfg.WatchDelay > 0 {
		c.timer = time.AfterFunc(time.Hour, c.watchSoon)
		c.timer.Stop()
	}
	return c
}

// abort closes the connection and cancels its request (Close).
func (c *h1Conn) abort() {
	c.nc.Close()
	c.wmu.Lock()
	ctx := c.cancel
	c.wmu.Unlock()
	if ctx != nil {
		ctx.cancel()
	}
}

func (c *h1Conn) serve() {
	s := c.s
	defer func() {
		if c.timer != nil {
			c.timer.Stop()
		}
		c.nc.Close()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		if s.cfg.Conns != nil {
			s.cfg.Conns.release()
		}
		s.wg.Done()
	}()
	for {
		if c.br.Buffered() == 0 {
			c.idleDeadline()
			// Shutdown parks a connection, then moves its read deadline
			// into the past; a deadline set here after that would hide it.
			if c.state.Load() == connHandover {
				c.handOver()
				return
			}
			if _, err := c.br.Peek(1); err != nil {
				if c.state.Load() == connHandover && c.br.Buffered() == 0 {
					c.handOver()
				}
				return
			}
		}
		if !c.state.CompareAndSwap(connIdle, connActive) {
			if !c.state.CompareAndSwap(connHandover, connActive) {
				return // Shutdown closed it while idle
			}
			// A request arrived as Shutdown parked the connection: it is
			// answered here (with "Connection: close"), not handed over.
			_ = c.nc.SetReadDeadline(time.Time{})
			c.idleUntil = time.Time{}
		}
		c.inHead.Store(true)
		if !c.serveRequest() {
			return
		}
		// Kept alive: a response that went out once Shutdown began said
		// "Connection: close" and ended the connection above, so this one
		// began earlier and its client may send another request on it at
		// any moment. Shutdown ends it as an idle one.
		c.state.Store(connIdle)
	}
}

// handOver gives the idle connection, with nothing of it read, to the
// listener's ConnHandover; the connection's own descriptor then closes
// (serve's defer) and the one handed over lives on. A refusal is logged:
// the connection closes as it would without a handover.
func (c *h1Conn) handOver() {
	if err := c.s.handover.HandOver(c.nc); err != nil {
		c.s.log.Debug("idle connection not handed over; closing it", zap.String("remote", c.remoteAddr), zap.Error(err))
	}
}

// serveRequest reads one request and answers it. It reports whether the
// connection may carry another.
func (c *h1Conn) serveRequest() bool {
	r, herr := c.readRequest()
	c.wmu.Lock()
	c.inHead.Store(false)
	c.wmu.Unlock()
	if herr != nil {
		if herr.status != 0 {
			c.writeError(herr)
			c.lingerClose()
		}
		return false
	}
	// The deadline left from the head (idle or header) stays when reading
	// the body cannot wait on the connection: no body, or all of it
	// buffered. Nothing reads the connection before the next request
	// then, but the disconnect watcher, which clears it first.
	if !c.body.buffered() {
		// The body has its own bound; bodyFinished clears it.
		c.idleUntil = time.Time{}
		_ = c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.BodyTimeout))
		c.inBody.Store(true)
		c.body.deadline = true
	}

	ctx := newReqCtx()
	// WithContext inlines here, so its copy stays off the heap.
	c.req = *r.WithContext(ctx)
	r = &c.req

	c.wmu.Lock()
	c.cancel = ctx
	c.bodyDone = c.body.mode == framingNone
	c.watchWanted = false
	c.gone = false
	c.wmu.Unlock()
	c.stopWatch.Store(false)
	switch d := c.s.cfg.WatchDelay; {
	case d < 0:
		c.watchSoon()
	default:
		c.timer.Reset(d)
	}

	w := &c.resp
	w.reset(r)
	panicked := c.runHandler(w, r)
	c.inBody.Store(false)
	gone := c.endWatch()
	ctx.cancel()
	if panicked || gone {
		return false
	}
	if err := w.finish(); err != nil {
		return false
	}
	keep := !w.closeAfter
	if !c.body.done() {
		if c.body.expectContinue && !c.body.continueSent {
			// The client is waiting to send a body nobody wants.
			c.lingerClose()
			return false
		}
		c.idleUntil = time.Time{}
		_ = c.nc.SetReadDeadline(time.Now().Add(min(c.s.cfg.BodyTimeout, lingerTimeout)))
		if !c.body.drain() {
			c.lingerClose()
			return false
		}
	}
	return keep
}

// runHandler calls the handler and turns its panics into the right end of
// the connection. It reports whether the handler panicked.
func (c *h1Conn) runHandler(w *h1Response, r *http.Request) (panicked bool) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		panicked = true
		if v != http.ErrAbortHandler { //nolint:errorlint // the sentinel is panicked as is
			c.s.log.Error("panic serving a request", zap.String("remote", c.remoteAddr),
				zap.String("path", r.URL.Path), zap.Any("panic", v), zap.Stack("stack"))
			if !w.committed {
				c.bw.Reset(c.nc) // nothing of this response was queued
				c.writeError(&httpError{status: http.StatusInternalServerError, msg: "internal error"})
				return
			}
		}
		// Complete chunks already queued go out; the response itself is
		// never ended, so the client sees it cut short.
		_ = c.bw.Flush()
	}()
	c.s.h.ServeHTTP(w, r)
	return false
}

// lingerClose closes the connection after telling the client no more is
// coming (a FIN after the answer), reading and discarding what it still
// sends until it stops: closing with unread bytes resets the connection,
// and the reset destroys the answer before the client reads it. Clients
// (the OpenAI SDKs among them) send a whole body before they read, so one
// refused with 413 would see "broken pipe" instead. The reading stops at
// the client's FIN, after maxLingerBytes, after lingerTimeout, or when
// Shutdown closes the connection.
func (c *h1Conn) lingerClose() {
	_ = c.bw.Flush()
	if cw, ok := c.nc.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		if c.state.CompareAndSwap(connActive, connLinger) {
			_ = c.nc.SetReadDeadline(time.Now().Add(lingerTimeout))
			_, _ = io.CopyN(io.Discard, c.nc, maxLingerBytes)
		}
	}
	c.nc.Close()
}

// watchSoon runs when a request has been in flight for watchDelay: it
// starts the disconnect watcher once the request body has been read.
func (c *h1Conn) watchSoon() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.cancel == nil || c.watchDone != nil {
		return
	}
	if !c.bodyDone {
		c.watchWanted = true
		return
	}
	c.startWatchLocked()
}

// bodyFinished is called by the body reader at the end of the body; it is
// the last thing the body reader does with the connection's reader.
func (c *h1Conn) bodyFinished() {
	c.inBody.Store(false)
	if c.body.deadline {
		_ = c.nc.SetReadDeadline(time.Time{})
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.bodyDone = true
	if c.watchWanted && c.watchDone == nil && c.cancel != nil {
		c.startWatchLocked()
	}
}

func (c *h1Conn) startWatchLocked() {
	done := make(chan struct{})
	c.watchDone = done
	go c.watch(c.cancel, done)
}

// watch waits for the client to send more or go away. Nothing else reads
// the connection while it runs: the body was read, and endWatch stops it
// before the next request is read. Bytes it reads stay in c.br for that
// request.
func (c *h1Conn) watch(ctx *reqCtx, done chan struct{}) {
	defer close(done)
	// The head's deadline may still be set (serveRequest leaves it when
	// the body was buffered). It is cleared before stopWatch is read:
	// endWatch stores stopWatch before it sets a past deadline, so either
	// this sees stopWatch, or the past deadline lands after the clear
	// and interrupts the read.
	_ = c.nc.SetReadDeadline(time.Time{})
	if c.stopWatch.Load() {
		return
	}
	if _, err := c.br.Peek(1); err == nil || c.stopWatch.Load() {
		return // pipelined bytes (the client is there), or stopped
	}
	c.wmu.Lock()
	c.gone = true
	c.wmu.Unlock()
	ctx.cancel()
}

// endWatch stops watching at the end of a request and reports whether the
// client went away. Once it returns no watcher runs, and none starts
// before the next request (a late timer sees no request in flight).
func (c *h1Conn) endWatch() (gone bool) {
	if c.timer != nil {
		c.timer.Stop()
	}
	c.wmu.Lock()
	done := c.watchDone
	c.watchWanted = false
	c.cancel = nil // the request is over for watchSoon and bodyFinished
	c.wmu.Unlock()
	if done != nil {
		c.stopWatch.Store(true)
		_ = c.nc.SetReadDeadline(aLongTimeAgo)
		<-done
		_ = c.nc.SetReadDeadline(time.Time{})
		c.idleUntil = time.Time{}
	}
	c.wmu.Lock()
	c.watchDone = nil
	gone = c.gone
	c.wmu.Unlock()
	return gone
}

var aLongTimeAgo = time.Unix(1, 0)

// idleDeadline bounds the wait for the next request by the idle timeout.
// A deadline serve set for an earlier wait that still has most of the
// timeout to run is kept (nothing has replaced it since): the idle bound
// is then between 7/8 and all of IdleTimeout, and a busy connection
// moves its timer once every IdleTimeout/8 instead of once per request.
func (c *h1Conn) idleDeadline() {
	d := c.s.cfg.IdleTimeout
	now := time.Now()
	if !c.idleUntil.IsZero() && deadlineFresh(c.idleUntil.Sub(now), d) {
		return
	}
	c.idleUntil = now.Add(d)
	_ = c.nc.SetReadDeadline(c.idleUntil)
}

// httpError is a request the server answers itself.
type httpError struct {
	status int // 0: close without an answer
	msg    string
}

func (e *httpError) Error() string { return e.msg }

// writeError answers a request the handler never saw, closing after.
func (c *h1Conn) writeError(e *httpError) {
	code := "bad_request"
	typ := typeInvalidRequest
	switch e.status {
	case http.StatusRequestHeaderFieldsTooLarge:
		code = "headers_too_large"
	case http.StatusNotImplemented:
		code = "not_implemented"
	case http.StatusHTTPVersionNotSupported:
		code = "http_version_not_supported"
	case http.StatusExpectationFailed:
		code = "expectation_failed"
	case http.StatusInternalServerError:
		code, typ = "internal_error", typeServer
	}
	body := (&APIError{Status: e.status, Type: typ, Code: code, Message: e.msg}).appendJSON(make([]byte, 0, 160))
	b := c.scratch[:0]
	b = append(b, statusLine(e.status)...)
	b = append(b, "Content-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\nDate: "...)
	b = appendDate(b)
	b = append(b, "\r\nContent-Length: "...)
	b = appendInt(b, int64(len(body)))
	b = append(b, "\r\n\r\n"...)
	b = append(b, body...)
	c.scratch = b[:0]
	_, _ = c.bw.Write(b)
	_ = c.bw.Flush()
}
