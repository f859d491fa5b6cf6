package main

import (
	"net"
	"os"
)

// sdNotify sends state to systemd's notification socket ($NOTIFY_SOCKET)
// when the agent runs under a Type=notify unit; elsewhere it does nothing.
func sdNotify(state string) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return
	}
	if path[0] == '@' {
		path = "\x00" + path[1:] // abstract socket
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return
	}
	defer conn.Close()
	_, _ = conn.Write([]byte(state))
}
