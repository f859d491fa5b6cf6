package proxy

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// hopHeaders are the hop-by-hop headers of RFC 9110 section 7.6.1; they
// describe one connection and are never forwarded.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// connectionNamed returns the header names h's Connection header lists
// (hop-by-hop by declaration), canonicalized; nil when there are none.
func connectionNamed(h http.Header) []string {
	var named []string
	for _, v := range h["Connection"] {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				named = append(named, http.CanonicalHeaderKey(f))
			}
		}
	}
	return named
}

// MeshHeaders are the only request headers an app's request carries over
// the mesh to a peer agent (and on to the peer's instance): an allowlist,
// so credentials under any name (Authorization, Cookie, X-Api-Key,
// Api-Key, ...) and anything else an app sends for this host alone never
// leave it. The peer adds the framing headers itself. The serving agent
// applies the same list to what a peer sends before its instance sees it:
// it does not rely on the consumer's goodwill. A query string does not
// cross the hop at all (the consumer sends none, the serving agent drops
// any): OpenAI's endpoints take none.
var MeshHeaders = []string{
	"Accept", "Idempotency-Key", "Openai-Beta", "Traceparent", "Tracestate",
	"User-Agent", "X-Idempotency-Key", "X-Request-Id",
}

// forwardable reports whether the header k may be forwarded: not
// hop-by-hop (nor named by the Connection header, connNamed), not a
// framing or routing header the proxy sets itself, and, with mesh, one of
// MeshHeaders.
func forwardable(k string, connNamed []string, mesh bool) bool {
	switch k { // hopHeaders, as a switch: it runs for every header
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return false
	}
	for _, h := range connNamed {
		if k == h {
			return false
		}
	}
	if mesh && !slices.Contains(MeshHeaders, k) {
		return false
	}
	switch k {
	case "Content-Length", "Host", RoleHeader, RefusedHeader, ClientHeader:
		return false
	}
	return true
}

// copyHeaders copies src into dst without hop-by-hop headers (including those
// src's Connection header names). mesh keeps MeshHeaders only.
func copyHeaders(dst, src http.Header, mesh bool) {
	connNamed := connectionNamed(src)
	for k, vv := range src {
		if forwardable(k, connNamed, mesh) {
			dst[k] = vv
		}
	}
}

// PeerResponseHeaders are the only headers of a peer agent's answer that
// reach the app (besides the framing this agent sets itself), with every
// header that starts with one of PeerResponseHeaderPrefixes: what
// OpenAI's SDKs and apps read of an answer (its type and encoding, the
// retry advice, rate limits, OpenAI's own). A peer is another host: its
// cookies, caching and security policy, and whatever else it sets, are
// not this host's. An instance's own answer (local path) passes whole.
//
// Either way X-Request-Id and every Infermesh-* header the app sees are
// this agent's own: the request's id as this agent made or took it, and
// Infermesh-Served-By naming the node that served it as this agent knows
// it (itself, or the node the peer's connection was verified as). Those an
// instance or a peer set are dropped.
var PeerResponseHeaders = []string{
	"Content-Encoding", "Content-Type", "Retry-After", "Retry-After-Ms", "X-Should-Retry",
}

// PeerResponseHeaderPrefixes: see PeerResponseHeaders.
var PeerResponseHeaderPrefixes = []string{"Openai-", "X-Ratelimit-"}

// responseHeaderOK reports whether the end-to-end response header k of an
// instance's answer (peer false) or a peer agent's (peer true) may reach
// the client.
func responseHeaderOK(k string, peer bool) bool {
	if k == RequestIDHeader || strings.HasPrefix(k, "Infermesh-") {
		return false
	}
	if !peer || slices.Contains(PeerResponseHeaders, k) {
		return true
	}
	for _, p := range PeerResponseHeaderPrefixes {
		if strings.HasPrefix(k, p) {
			return true
		}
	}
	return false
}

// copyResponseHeaders copies the response headers of src that may reach
// the client (responseHeaderOK) into dst.
func copyResponseHeaders(dst, src http.Header, peer bool) {
	connNamed := connectionNamed(src)
	for k, vv := range src {
		if forwardable(k, connNamed, false) && responseHeaderOK(k, peer) {
			dst[k] = vv
		}
	}
}

// validHeaderValue reports whether v can be written on an HTTP/1.1 header
// line as it is (no control characters but tab).
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// appendRequestHead appends the head of the request forwarded to a local
// instance: the request line, Host, the client's end-to-end headers (only
// MeshHeaders, and no query, for a peer's request: see MeshHeaders),
// Content-Type and Content-Length n.
//
// A non-empty key replaces the client's Authorization with the instance's
// own key.
func appendRequestHead(dst []byte, r *http.Request, host, path string, n int, key string, peer bool) []byte {
	dst = append(dst, "POST "...)
	dst = append(dst, path...)
	if q := r.URL.RawQuery; q != "" && !peer {
		dst = append(dst, '?')
		dst = append(dst, q...)
	}
	dst = append(dst, " HTTP/1.1\r\nHost: "...)
	dst = append(dst, host...)
	dst = append(dst, "\r\n"...)
	connNamed := connectionNamed(r.Header)
	for k, vv := range r.Header {
		if k == "Content-Type" || !forwardable(k, connNamed, peer) || (key != "" && k == "Authorization") {
			continue
		}
		for _, v := range vv {
			if !validHeaderValue(v) {
				continue
			}
			dst = append(dst, k...)
			dst = append(dst, ": "...)
			dst = append(dst, v...)
			dst = append(dst, "\r\n"...)
		}
	}
	if key != "" {
		dst = append(dst, "Authorization: Bearer "...)
		dst = append(dst, key...)
		dst = append(dst, "\r\n"...)
	}
	dst = append(dst, "Content-Type: application/json\r\nContent-Length: "...)
	dst = strconv.AppendInt(dst, int64(n), 10)
	return append(dst, "\r\n\r\n"...)
}

// replayable reports whether the client marked its request safe to send
// twice, as http.Transport reads it.
func replayable(h http.Header) bool {
	return len(h["Idempotency-Key"]) > 0 || len(h["X-Idempotency-Key"]) > 0
}
