package proxy

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// h1Server is the HTTP/1.1 server of the loopback role ports. It replaces
// net/http's server there, where its per-request cost (a background-read
// goroutine, request parsing into fresh maps and strings, the response's
// layered buffers) was most of what the proxy itself spent.
//
// What it does: keep-alive and HTTP/1.0; request bodies with Content-Length
// or chunked; Expect: 100-continue; a bound on the request head (431), a
// read-header timeout and an idle timeout; 400 and a closed connection for
// malformed requests; requests served one after another on a connection
// (pipelined requests wait their turn). Responses carry Content-Length when
// the handler set it or finished within a small buffer, are chunked
// otherwise, and are flushed through http.Flusher / http.ResponseController.
// panic(http.ErrAbortHandler) cuts the connection without ending the
// response; any other panic is logged and answered with a 500 when nothing
// was sent yet.
//
// Client disconnects cancel the request context. A connection is only
// watched (a read in the background) once a request has been in flight for
// watchDelay: instant answers never pay for the watcher.
//
// Per connection it reuses the reader, the writer, the http.Request, the
// header maps and the response writer, so handlers must not keep any of
// them after ServeHTTP returns (the proxy's handlers do not), nor read the
// body and write the response from different goroutines at once.
//
// Serve, Shutdown and Close are safe for concurrent use; Shutdown and Close
// are idempotent.
type h1Server struct {
	h   http.Handler
	cfg h1Config
	log *zap.Logger

	stopping atomic.Bool   // Shutdown or Close began
	quit     chan struct{} // closed when stopping begins
	graceEnd time.Time     // Shutdown's deadline for heads and blocked writes; set before quit closes
	idleEnd  time.Time     // Shutdown closes idle connections from then on (no handover); set with graceEnd
	handover ConnHandover  // the listener's, when idle connections can outlive this server; set by Serve

	mu        sync.Mutex
	ln        net.Listener
	conns     map[*h1Conn]struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup // connection goroutines
}

// h1Config tunes an h1Server. Zero values mean the defaults.
type h1Config struct {
	// ReadHeaderTimeout bounds reading a request head once its first byte
	// arrived. Default 10s.
	ReadHeaderTimeout time.Duration
	// IdleTimeout bounds the wait for the next request on a kept-alive
	// connection. Default 120s.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's line and headers; more is answered
	// 431. Default 64 KiB.
	MaxHeaderBytes int
	// WatchDelay is how long a request runs before its connection is
	// watched for a client disconnect. Default 20ms; negative watches at
	// once.
	WatchDelay time.Duration
	// BodyTimeout bounds reading a request body, and draining what the
	// handler left of one. Default 60s.
	BodyTimeout time.Duration
	// WriteTimeout bounds each write to the client (a stalled reader
	// fails its stream after it). Default 60s.
	WriteTimeout time.Duration
	// DrainIdle is how long Shutdown keeps a kept-alive connection open
	// while it waits for a request, when the listener cannot hand it over
	// (see Shutdown). Default 1s.
	DrainIdle time.Duration
	// Conns caps the connections, shared with other servers; nil: no cap.
	Conns *connLimiter
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
}

func (c *h1Config) fill() {
	if c.BodyTimeout <= 0 {
		c.BodyTimeout = 60 * time.Second
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = 60 * time.Second
	}
	if c.ReadHeaderTimeout <= 0 {
		c.ReadHeaderTimeout = 10 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 120 * time.Second
	}
	if c.DrainIdle <= 0 {
		c.DrainIdle = time.Second
	}
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.WatchDelay == 0 {
		c.WatchDelay = 20 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
}

func newH1Server(h http.Handler, cfg h1Config) *h1Server {
	cfg.fill()
	return &h1Server{h: h, cfg: cfg, log: cfg.Logger, quit: make(chan struct{}), conns: map[*h1Conn]struct{}{}}
}

// errServerClosed is returned by Serve once Shutdown or Close began.
var errServerClosed = http.ErrServerClosed

// Serve accepts connections on ln until Shutdown or Close, and serves each
// on its own goroutine. It always returns a non-nil error:
// errServerClosed after Shutdown or Close.
func (s *h1Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.stopping.Load() {
		s.mu.Unlock()
		ln.Close()
		return errServerClosed
	}
	s.ln = ln
	if h, ok := ln.(ConnHandover); ok {
		s.handover = h
	}
	s.mu.Unlock()
	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.stopping.Load() {
				return errServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Out of descriptors and the like: wait and try again, as
			// net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("accept failed; retrying", zap.Error(err), zap.Duration("in", backoff))
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-s.quit:
				t.Stop()
				return errServerClosed
			}
			continue
		}
		backoff = 0
		if !s.admit(nc) {
			continue
		}
		c := newH1Conn(s, nc)
		s.mu.Lock()
		if s.stopping.Load() {
			s.mu.Unlock()
			nc.Close()
			return errServerClosed
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go c.serve()
	}
}

// admit counts nc against the connection cap. Near the cap it closes idle
// connections early, to make room; at it, nc is answered 503 and closed.
func (s *h1Server) admit(nc net.Conn) bool {
	l := s.cfg.Conns
	if l == nil {
		return true
	}
	if l.near() {
		s.reapIdle(2) // more than the one arriving, so the count goes down
	}
	if l.acquire() {
		return true
	}
	_ = nc.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = nc.Write(tooManyConns)
	nc.Close()
	return false
}

// reapIdle closes up to n connections waiting for a request.
func (s *h1Server) reapIdle(n int) {
	var idle []*h1Conn
	s.mu.Lock()
	for c := range s.conns {
		if len(idle) == n {
			break
		}
		if c.state.CompareAndSwap(connIdle, connClosed) {
			idle = append(idle, c)
		}
	}
	s.mu.Unlock()
	for _, c := range idle {
		c.nc.Close()
	}
}

// beginStop stops accepting.
func (s *h1Server) beginStop() {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		now := time.Now()
		s.graceEnd = now.Add(shutdownGrace)
		s.idleEnd = now.Add(s.cfg.DrainIdle)
		s.stopping.Store(true)
		close(s.quit)
		ln := s.ln
		s.mu.Unlock()
		if ln != nil {
			ln.Close()
		}
	})
}

// Shutdown stops accepting, waits for the requests in flight (streams
// included) to finish, and ends the idle connections without ever
// closing one a request may be on its way over; when ctx ends first it
// closes what is left and returns ctx's error.
//
// The drain follows Envoy's rule for HTTP/1.1, not nginx's (which closes
// idle keep-alive connections at once, racing with a client's next
// request): every response whose head goes out once the drain began
// carries "Connection: close" and its connection closes after it. A
// connection whose last response went out before (idle at the start, or
// a stream that began earlier) is not closed under the client: when the
// listener can hand connections over (ConnHandover: systemd's file
// descriptor store keeps them for the next agent), it is handed over as
// soon as it is idle, with nothing of it read; otherwise it stays open
// for DrainIdle, so that a client between two requests sends its next one
// and is answered with "Connection: close", and only a connection idle
// for all of DrainIdle is closed then.
func (s *h1Server) Shutdown(ctx context.Context) error {
	s.beginStop()
	wait := time.Millisecond
	for {
		if s.closeIdle() == 0 {
			s.wg.Wait()
			return nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			s.Close()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// closeIdle ends the idle connections as Shutdown says (handed over, or
// closed once DrainIdle is over), closes those lingering or still sending
// a request body (a stalled body would hold Shutdown for its whole
// timeout), gives those reading a request head and those in a blocked
// write until graceEnd (a slowloris or a stalled reader would hold it for
// the header or write timeout), and returns how many connections are
// still open.
func (s *h1Server) closeIdle() int {
	var idle, parked, inBody, active []*h1Conn
	open := 0
	s.mu.Lock()
	idleOver := !time.Now().Before(s.idleEnd)
	for c := range s.conns {
		switch {
		case c.state.CompareAndSwap(connLinger, connClosed):
			idle = append(idle, c)
		case s.handover != nil && c.state.CompareAndSwap(connIdle, connHandover):
			parked = append(parked, c)
			open++
		case idleOver && c.state.CompareAndSwap(connIdle, connClosed):
			idle = append(idle, c)
		case c.state.Load() == connActive:
			if c.inBody.Load() {
				inBody = append(inBody, c)
			} else {
				active = append(active, c)
			}
			open++
		case c.state.Load() != connClosed:
			open++ // idle within DrainIdle, or parked and not yet handed over
		}
	}
	graceEnd := s.graceEnd
	s.mu.Unlock()
	for _, c := range idle {
		c.nc.Close()
	}
	for _, c := range parked {
		// Wakes its serve goroutine from the wait for a request; it hands
		// the connection over when nothing arrived (see serve).
		_ = c.nc.SetReadDeadline(aLongTimeAgo)
	}
	for _, c := range inBody {
		c.abort()
	}
	for _, c := range active {
		if !c.graced.Swap(true) {
			// Once: later writes get shutdownGrace each (deadlineConn).
			_ = c.nc.SetWriteDeadline(graceEnd)
		}
		// Under wmu, so the deadline cannot land after the head was read
		// (serveRequest clears it there). Repeated: serve may have set
		// the header timeout just after an earlier pass.
		c.wmu.Lock()
		if c.inHead.Load() {
			_ = c.nc.SetReadDeadline(graceEnd)
		}
		c.wmu.Unlock()
	}
	return open
}

// Close stops accepting and closes every connection at once, cancelling
// the requests in flight, then waits for their goroutines to return.
func (s *h1Server) Close() error {
	s.beginStop()
	s.mu.Lock()
	all := make([]*h1Conn, 0, len(s.conns))
	for c := range s.conns {
		c.state.Store(connClosed)
		all = append(all, c)
	}
	s.mu.Unlock()
	for _, c := range all {
		c.abort()
	}
	s.wg.Wait()
	return nil
}
