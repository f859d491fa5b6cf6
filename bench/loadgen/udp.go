package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// udpFacts describes the host's UDP set-up that the QUIC hop runs on, for
// the report header: the buffer sysctls in force and whether UDP GSO is on
// as quic-go decides it (the kernel accepts UDP_SEGMENT on a UDP socket and
// QUIC_GO_DISABLE_GSO is not set). quic-go v0.65 does not use UDP GRO; it
// reads packets in batches (recvmmsg).
func udpFacts() map[string]string {
	f := map[string]string{}
	var sys []string
	for _, k := range []string{"rmem_max", "wmem_max", "rmem_default", "wmem_default"} {
		b, err := os.ReadFile("/proc/sys/net/core/" + k)
		v := "unknown"
		if err == nil {
			v = strings.TrimSpace(string(b))
		}
		sys = append(sys, k+"="+v)
	}
	f["udp sysctl"] = "net.core " + strings.Join(sys, " ")
	f["udp gso"] = gsoState()
	return f
}

func gsoState() string {
	if d, err := strconv.ParseBool(os.Getenv("QUIC_GO_DISABLE_GSO")); err == nil && d {
		return "off (QUIC_GO_DISABLE_GSO)"
	}
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return "unknown: " + err.Error()
	}
	defer c.Close()
	rc, err := c.SyscallConn()
	if err != nil {
		return "unknown: " + err.Error()
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { _, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_UDP, unix.UDP_SEGMENT) }); err != nil {
		serr = err
	}
	if serr != nil {
		return fmt.Sprintf("off (the kernel refuses UDP_SEGMENT: %v)", serr)
	}
	return "on (UDP_SEGMENT; GRO unused by quic-go)"
}
