//go:build unix

package proxy

import (
	"errors"
	"net"
	"syscall"
)

// peerClosed reports whether the instance closed the idle connection nc
// (or sent bytes no request asked for): a peek that does not wait sees the
// FIN, so a request is never written onto a connection already gone.
func peerClosed(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	closed := false
	var b [1]byte
	_ = rc.Read(func(fd uintptr) bool {
		_, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case err == nil:
			closed = true // EOF (n == 0), or unasked-for bytes (n > 0)
		case errors.Is(err, syscall.EAGAIN), errors.Is(err, syscall.EWOULDBLOCK), errors.Is(err, syscall.EINTR):
		default:
			closed = true // a reset
		}
		return true
	})
	return closed
}
