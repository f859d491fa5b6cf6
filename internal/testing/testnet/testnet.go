// Package testnet finds free loopback ports for tests that must write a
// port into a configuration before the listener exists (an agent's role
// port, its QUIC and gossip addresses). Elsewhere, tests listen on :0.
//
// A port found free can be taken by someone else before it is bound again;
// on a shared machine that is rare, and a test failing on it says so
// (address in use).
package testnet

import (
	"fmt"
	"net"
	"testing"
)

// TCPPort returns a TCP port nobody listens on at ip right now.
func TCPPort(t testing.TB, ip string) int {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// UDPPort returns a UDP port nobody has bound at ip right now.
func UDPPort(t testing.TB, ip string) int {
	t.Helper()
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	return pc.LocalAddr().(*net.UDPAddr).Port
}

// TCPUDPPort returns a port free for both TCP and UDP at ip (memberlist
// binds both on one port).
func TCPUDPPort(t testing.TB, ip string) int {
	t.Helper()
	for range 20 {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		pc, err := net.ListenPacket("udp", net.JoinHostPort(ip, fmt.Sprint(port)))
		ln.Close()
		if err == nil {
			pc.Close()
			return port
		}
	}
	t.Fatalf("no port free for both TCP and UDP at %s", ip)
	return 0
}
