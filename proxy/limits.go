package proxy

import (
	"math"
	"net"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"
)

// fdReserve is how many file descriptors the connection cap leaves to the
// rest of the agent (the admin socket, the mesh, state files, dials).
const fdReserve = 256

// defaultMaxConns derives the connection cap from the open-file limit: a
// proxied request holds two descriptors (the client's, the instance's).
func defaultMaxConns() int {
	n, limit, ok := fdBudget()
	if !ok {
		return 1024
	}
	if limit > 1<<20 {
		n = (1<<20 - fdReserve) / 2
	}
	return int(min(max(n, 64), 32768))
}

// fdBudget is how many client connections the open-file limit leaves room
// for, (limit - fdReserve) / 2, and the limit; ok is false when the limit
// is unknown.
func fdBudget() (budget int64, limit uint64, ok bool) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == 0 {
		return 0, 0, false
	}
	return (int64(min(rl.Cur, math.MaxInt64/2)) - fdReserve) / 2, rl.Cur, true
}

// connLimiter counts client connections against a cap. Safe for
// concurrent use.
type connLimiter struct {
	max  int64
	open atomic.Int64
}

// acquire counts a new connection, or reports that the cap is reached.
func (l *connLimiter) acquire() bool {
	if l.open.Add(1) > l.max {
		l.open.Add(-1)
		return false
	}
	return true
}

func (l *connLimiter) release() { l.open.Add(-1) }

// near reports whether the open connections are within a tenth of the cap:
// time to close idle ones early.
func (l *connLimiter) near() bool { return l.open.Load()*10 >= l.max*9 }

// shutdownGrace is what a connection gets once Shutdown began: to finish
// sending a request head, and for each write of a response. A client
// that sends or reads normally needs far less on loopback; a slowloris
// or a stalled reader would otherwise hold the stop for the header or
// write timeout.
const shutdownGrace = 2 * time.Second

// deadlineConn gives every Write a fresh deadline, so a client that stops
// reading fails the write after d instead of holding its stream (and the
// instance's slot) forever. Caddy wraps its conns the same way. Once
// stop is set (Shutdown began) the deadline is at most shutdownGrace.
//
// A deadline set by an earlier write that still has 7/8 of d to run is
// kept: a stalled write fails after 7/8 of d to d, and a busy connection
// moves its timer once every d/8 rather than once per write (moving it
// takes the poller's and the timer heap's locks).
type deadlineConn struct {
	net.Conn
	d     time.Duration
	stop  *atomic.Bool
	until atomic.Int64 // the deadline set last, as monoSince; 0: none or unknown
}

// deadlineFresh reports whether a deadline with left to run may stay in
// place of a fresh one of d: it still has 7/8 of d. Moving a deadline
// takes the poller's and the timer heap's locks, so the connection
// deadlines (idle, write, the instance's head) are moved once every d/8
// on a busy connection rather than once per request, and fire after 7/8
// of d to d.
func deadlineFresh(left, d time.Duration) bool { return left >= d-d/8 }

// monoBase is the reference of monoSince.
var monoBase = time.Now()

// monoSince is t on the monotonic clock, as a duration since monoBase.
func monoSince(t time.Time) time.Duration { return t.Sub(monoBase) }

func (c *deadlineConn) Write(p []byte) (int, error) {
	d := c.d
	now := time.Now()
	if c.stop.Load() {
		// Shutdown may have set its own deadline (closeIdle): always fresh.
		d = min(d, shutdownGrace)
		c.until.Store(0)
	} else if u := c.until.Load(); u != 0 && deadlineFresh(time.Duration(u)-monoSince(now), d) {
		return c.Conn.Write(p)
	} else {
		c.until.Store(int64(monoSince(now.Add(d))))
	}
	_ = c.Conn.SetWriteDeadline(now.Add(d))
	return c.Conn.Write(p)
}

// CloseWrite half-closes when the wrapped connection can.
func (c *deadlineConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// tooManyConns is the answer to a connection over the cap.
var tooManyConns = func() []byte {
	body := `{"error":{"message":"the proxy is at its connection limit; retry shortly","type":"service_unavailable","param":null,"code":"too_many_connections"}}` + "\n"
	return []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}()
