//go:build !unix

package proxy

import "net"

// peerClosed cannot peek without waiting here: a closed idle connection
// is found when the request fails on it.
func peerClosed(net.Conn) bool { return false }
