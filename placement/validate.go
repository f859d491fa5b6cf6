package placement

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// MaxRoleLen is the longest role name accepted.
const MaxRoleLen = 64

// ErrBadRole is wrapped by every role validation failure.
var ErrBadRole = errors.New("bad role")

// ErrBadBase is wrapped by every local base URL validation failure.
var ErrBadBase = errors.New("bad local base url")

// ValidateRole reports whether role is usable as a role name: non-empty, at
// most MaxRoleLen bytes, made only of the token characters [A-Za-z0-9._-]
// (so never a '/'), and not "." or "..". Errors wrap ErrBadRole.
func ValidateRole(role string) error {
	switch {
	case role == "":
		return fmt.Errorf("%w: empty", ErrBadRole)
	case len(role) > MaxRoleLen:
		return fmt.Errorf("%w %.16q...: longer than %d bytes", ErrBadRole, role, MaxRoleLen)
	case role == "." || role == "..":
		return fmt.Errorf("%w %q: dot name", ErrBadRole, role)
	}
	for i := 0; i < len(role); i++ {
		if !isTokenByte(role[i]) {
			return fmt.Errorf("%w %q: character %q at %d is not one of [A-Za-z0-9._-]", ErrBadRole, role, role[i], i)
		}
	}
	return nil
}

func isTokenByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '.' || c == '_' || c == '-'
}

// ParseLoopbackBase checks that base is the base URL of a server on this
// host and returns its canonical form, "http://<host>:<port>" without a
// trailing slash. The rules, each of which keeps a local instance from being
// anything but a loopback server:
//
//   - the scheme is http (loopback traffic needs no TLS, and https would
//     hide a non-local name behind a certificate);
//   - the host is an IPv4 address in 127.0.0.0/8, the IPv6 address ::1
//     (in brackets), or the name "localhost"; IPv4-mapped IPv6 addresses
//     and zones are refused;
//   - an explicit port 1-65535 is present;
//   - there is no user info, query or fragment, and the path is "" or "/".
//
// Errors wrap ErrBadBase.
func ParseLoopbackBase(base string) (string, error) {
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("%w %q: %s", ErrBadBase, base, why)
	}
	u, err := url.Parse(base)
	if err != nil {
		return bad("does not parse")
	}
	if u.Scheme != "http" {
		return bad("scheme must be http")
	}
	if u.Opaque != "" || u.Host == "" {
		return bad("no host")
	}
	if u.User != nil {
		return bad("user info not allowed")
	}
	if u.RawQuery != "" || u.ForceQuery {
		return bad("query not allowed")
	}
	if u.Fragment != "" || u.RawFragment != "" || strings.Contains(base, "#") {
		return bad("fragment not allowed")
	}
	if (u.Path != "" && u.Path != "/") || (u.RawPath != "" && u.RawPath != "/") {
		return bad("path must be empty or /")
	}
	portStr := u.Port()
	if portStr == "" {
		return bad("port required")
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return bad("port must be 1-65535")
	}
	host := u.Hostname()
	if strings.EqualFold(host, "localhost") {
		return "http://localhost:" + strconv.FormatUint(port, 10), nil
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return bad("host must be a loopback IP or localhost")
	}
	switch {
	case addr.Zone() != "":
		return bad("zoned address not allowed")
	case addr.Is4() && addr.As4()[0] == 127:
		return "http://" + addr.String() + ":" + strconv.FormatUint(port, 10), nil
	case addr.Is6() && !addr.Is4In6() && addr == netip.IPv6Loopback():
		return "http://[::1]:" + strconv.FormatUint(port, 10), nil
	default:
		return bad("host is not a loopback address (127.0.0.0/8, ::1, localhost)")
	}
}

// IsLoopbackBase reports whether ParseLoopbackBase accepts base.
func IsLoopbackBase(base string) bool {
	_, err := ParseLoopbackBase(base)
	return err == nil
}

// LoopbackProxyBase is the base URL ("http://127.0.0.1:<port>/v1") apps use
// to reach this node's loopback proxy listener on port.
func LoopbackProxyBase(port uint16) string {
	return "http://127.0.0.1:" + strconv.FormatUint(uint64(port), 10) + "/v1"
}
