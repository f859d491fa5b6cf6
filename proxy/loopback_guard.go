package proxy

import (
	"net"
	"net/netip"
	"net/url"
	"strings"
)

// loopbackHost reports whether host (a Host header value or URL host, with or
// without a port) names this machine's loopback interface. Anything else is
// refused: a browser page on another origin that resolved its own name to
// 127.0.0.1 (DNS rebinding) sends its own name as Host.
func loopbackHost(host string) bool {
	if host == "" {
		return false
	}
	h := host
	if sh, _, err := net.SplitHostPort(host); err == nil {
		h = sh
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(h)
	return err == nil && ip.IsLoopback()
}

// LoopbackHost reports whether host, a Host header value or URL host with
// or without a port, names this machine's loopback interface (the guard
// the proxy puts before every role port, for other loopback servers).
func LoopbackHost(host string) bool { return loopbackHost(host) }

// checkBrowserOrigin refuses requests that carry an Origin that is not a
// loopback origin: web pages must not drive the local model endpoint.
func checkBrowserOrigin(origin string) bool {
	if origin == "" {
		return true
	}
	u, err := url.Parse(origin)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
		return false
	}
	return loopbackHost(u.Host)
}

// IsLoopbackAddr reports whether a listen address binds a loopback IP only.
func IsLoopbackAddr(addr string) bool {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(h)
	return err == nil && ip.IsLoopback()
}
