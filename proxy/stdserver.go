package proxy

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// httpServer is what a role port's server does: h1Server, or net/http's
// behind stdServer. Serve returns http.ErrServerClosed after Shutdown or
// Close; Shutdown and Close are idempotent and safe for concurrent use.
type httpServer interface {
	Serve(ln net.Listener) error
	Shutdown(ctx context.Context) error
	Close() error
}

var (
	_ httpServer = (*h1Server)(nil)
	_ httpServer = (*stdServer)(nil)
)

// Server implementations (Config.Server).
const (
	ServerInfermesh = "infermesh" // h1Server and upstreamClient (default)
	ServerStd       = "std"       // net/http's server and http.Transport
)

// stdServer is net/http's server with the same bounds as h1Server: the
// connection cap (at the listener), a write deadline per write (on each
// connection), a read deadline on the request body (per request, through
// http.ResponseController), and Shutdown closing connections still
// sending a body. It is the known-good fallback (proxy.server: std) and
// the reference the fast path is measured against.
type stdServer struct {
	srv *http.Server
	cfg h1Config

	stopping atomic.Bool // Shutdown began

	mu     sync.Mutex
	idle   map[net.Conn]bool
	inBody map[net.Conn]bool
	conns  map[net.Conn]http.ConnState // every open connection
}

type connKey struct{}

func newStdServer(h http.Handler, cfg h1Config) *stdServer {
	cfg.fill()
	s := &stdServer{cfg: cfg, idle: map[net.Conn]bool{}, inBody: map[net.Conn]bool{}, conns: map[net.Conn]http.ConnState{}}
	s.srv = &http.Server{
		Handler:           http.HandlerFunc(s.serve(h)),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ErrorLog:          log.New(io.Discard, "", 0),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
		ConnState: func(c net.Conn, st http.ConnState) {
			s.mu.Lock()
			if st == http.StateIdle || st == http.StateNew {
				s.idle[c] = true
			} else {
				delete(s.idle, c)
			}
			if st != http.StateActive {
				delete(s.inBody, c)
			}
			if st == http.StateClosed || st == http.StateHijacked {
				delete(s.conns, c)
			} else {
				s.conns[c] = st
			}
			s.mu.Unlock()
		},
	}
	return s
}

// serve bounds the request body's reading in time and records the
// connection as sending one until its end.
func (s *stdServer) serve(h http.Handler) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Body == http.NoBody || r.ContentLength == 0 {
			h.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Now().Add(s.cfg.BodyTimeout))
		c, _ := r.Context().Value(connKey{}).(net.Conn)
		b := &stdBody{ReadCloser: r.Body, done: func() {
			_ = rc.SetReadDeadline(time.Time{})
			s.mu.Lock()
			delete(s.inBody, c)
			s.mu.Unlock()
		}}
		s.mu.Lock()
		s.inBody[c] = true
		s.mu.Unlock()
		// A body left unread keeps its deadline (and its place in inBody):
		// net/http drains it after the handler, which must not hang.
		r.Body = b
		h.ServeHTTP(w, r)
	}
}

// stdBody calls done once, at the body's end.
type stdBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *stdBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.finish()
	}
	return n, err
}

func (b *stdBody) finish() { b.once.Do(b.done) }

func (s *stdServer) Serve(ln net.Listener) error {
	conns := s.cfg.Conns
	if conns == nil {
		conns = &connLimiter{max: 1 << 62}
	}
	return s.srv.Serve(&limitListener{Listener: ln, conns: conns, reap: s.reapIdle, wt: s.cfg.WriteTimeout, stop: &s.stopping, log: s.cfg.Logger})
}

// reapIdle closes up to n idle connections.
func (s *stdServer) reapIdle(n int) {
	var idle []net.Conn
	s.mu.Lock()
	for c := range s.idle {
		if len(idle) == n {
			break
		}
		idle = append(idle, c)
		delete(s.idle, c)
	}
	s.mu.Unlock()
	for _, c := range idle {
		c.Close()
	}
}

// Shutdown gives the connections yet to send a whole request head and
// those in a blocked write shutdownGrace (as the h1 server does), then
// shuts net/http's server down (idle connections close, requests finish)
// and, until it returns, closes every connection still sending a body: a
// stalled body would hold it for its whole timeout. The closing is
// repeated because a connection whose head was still being read when
// Shutdown began reaches its body later.
func (s *stdServer) Shutdown(ctx context.Context) error {
	s.stopping.Store(true)
	s.grace(time.Now().Add(shutdownGrace))
	done := make(chan error, 1)
	go func() { done <- s.srv.Shutdown(ctx) }()
	wait := time.Millisecond
	for {
		s.closeStalled()
		t := time.NewTimer(wait)
		select {
		case err := <-done:
			t.Stop()
			return err
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// grace puts end as the read deadline of the connections net/http has
// not read a request head from yet, and as the write deadline of those
// not sending a body (later writes get shutdownGrace each).
func (s *stdServer) grace(end time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c, st := range s.conns {
		if st == http.StateNew {
			// net/http sets the header deadline as it starts reading a
			// head, so a connection it has not started on keeps its own
			// (closed by its Shutdown after 5 s at most).
			_ = c.SetReadDeadline(end)
		}
		if !s.inBody[c] {
			_ = c.SetWriteDeadline(end)
		}
	}
}

// closeStalled closes the connections still sending a request body.
func (s *stdServer) closeStalled() {
	s.mu.Lock()
	var stalled []net.Conn
	for c := range s.inBody {
		stalled = append(stalled, c)
		delete(s.inBody, c)
	}
	s.mu.Unlock()
	for _, c := range stalled {
		c.Close()
	}
}

func (s *stdServer) Close() error { return s.srv.Close() }

// limitListener counts accepted connections against the cap (closing
// idle ones early near it, answering 503 at it) and puts a deadline on
// each write.
type limitListener struct {
	net.Listener
	conns *connLimiter
	reap  func(n int)
	wt    time.Duration
	stop  *atomic.Bool
	log   *zap.Logger
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				// net/http retries after a growing pause; its own log is
				// discarded.
				l.log.Warn("accept failed; retrying", zap.Error(err))
			}
			return nil, err
		}
		if l.conns.near() {
			l.reap(2)
		}
		if !l.conns.acquire() {
			_ = nc.SetWriteDeadline(time.Now().Add(time.Second))
			_, _ = nc.Write(tooManyConns)
			nc.Close()
			continue
		}
		return &countedConn{deadlineConn: deadlineConn{Conn: nc, d: l.wt, stop: l.stop}, release: l.conns.release}, nil
	}
}

// countedConn gives its slot back once closed.
type countedConn struct {
	deadlineConn
	once    sync.Once
	release func()
}

func (c *countedConn) Close() error {
	c.once.Do(c.release)
	return c.deadlineConn.Close()
}
