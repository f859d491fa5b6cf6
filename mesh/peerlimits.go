package mesh

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// What one admitted peer may hold here, and what this node accepts from a
// peer it asked. The bounds are counted per authenticated node, in our own
// code around the accepted connection, the request handler and the
// response, not only as options of the HTTP/3 library: QUIC's stream limit
// is per connection, so alone it lets one key multiply it by opening more
// connections, and a framing of our own over raw QUIC streams would not
// have the library's options at all.
//
//   - connections: at most MaxConnsPerPeer at once per node (an agent keeps
//     one; a restart leaves the old one open until its idle timeout);
//     another is closed right after its handshake (H3_EXCESSIVE_LOAD);
//   - requests in flight: at most MaxStreamsPerPeer per node across all of
//     its connections (each connection also allows at most that many
//     streams, so a peer with one connection waits for a free stream
//     instead of being refused); another is answered 503 too_many_streams
//     with Retry-After. The liveness probe is answered at once and is not
//     counted;
//   - a request body: read within BodyTimeout from the start of the
//     request (the stream's read deadline); the proxy then answers 408;
//   - a response head from a peer: at most MaxHeadBytes (the field
//     section size of RFC 9114: name, value and 32 per field).
//
// Each refusal is counted (Refusals) and reported to OnRefused at most
// once per peer and reason every 10 s, not once per stream.

// Reasons of the per-peer bounds (OnRefused's why, keys of Refusals).
const (
	RefusedTooManyConns   = "too_many_connections"
	RefusedTooManyStreams = "too_many_streams"
)

// MaxHeadBytes bounds a request head a peer sends here and a response head
// a peer sends back (HTTP/3 field section size), as the proxy bounds heads
// on the loopback ports and from local instances.
const MaxHeadBytes = 64 << 10

// ErrResponseHeadTooLarge is wrapped by RoundTrip when the peer's response
// head is over MaxHeadBytes: the response is dropped unread, the peer is
// to blame.
var ErrResponseHeadTooLarge = errors.New("the peer's response head is over the 64 KiB limit")

// peerLoad is what one node holds here across its connections.
type peerLoad struct {
	conns   int // guarded by Transport.mu
	streams atomic.Int64
}

// acquire counts one more request in flight, or reports that max are.
func (l *peerLoad) acquire(max int64) bool {
	if l.streams.Add(1) > max {
		l.streams.Add(-1)
		return false
	}
	return true
}

func (l *peerLoad) release() { l.streams.Add(-1) }

// limitedListener is the QUIC listener the HTTP/3 server accepts from: it
// registers each verified connection under its node and closes one over
// MaxConnsPerPeer before any stream of it is served.
type limitedListener struct {
	*quic.Listener
	t *Transport
}

func (l limitedListener) Accept(ctx context.Context) (*quic.Conn, error) {
	for {
		c, err := l.Listener.Accept(ctx)
		if err != nil {
			return nil, err
		}
		if l.t.admitConn(c) {
			return c, nil
		}
	}
}

// admitConn registers c, verified in its handshake, as one of its node's
// connections, or closes it when the node holds MaxConnsPerPeer already.
// The count drops when the connection ends.
func (t *Transport) admitConn(c *quic.Conn) bool {
	cs := c.ConnectionState().TLS
	node, key, ok := peerOfState(&cs)
	if !ok {
		// The handshake verified a certificate: this cannot happen.
		_ = c.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeInternalError), "no verified identity")
		return false
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		_ = c.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), "")
		return false
	}
	l := t.load[node]
	if l == nil {
		l = &peerLoad{}
		t.load[node] = l
	}
	if l.conns >= t.cfg.MaxConnsPerPeer {
		n := l.conns
		t.mu.Unlock()
		t.refused(&refusalError{why: RefusedTooManyConns, node: node,
			msg: fmt.Sprintf("node %q already holds %d connections here (mesh.max_conns_per_peer)", node, n)}, "")
		_ = c.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeExcessiveLoad), "too many connections from this node")
		return false
	}
	l.conns++
	t.served[c] = &verified{node: node, key: key, load: l}
	t.mu.Unlock()
	context.AfterFunc(c.Context(), func() { t.dropConn(node, l) })
	return true
}

// dropConn uncounts an ended connection of node; its record goes once
// nothing of the node is left here.
func (t *Transport) dropConn(node string, l *peerLoad) {
	t.mu.Lock()
	l.conns--
	if l.conns == 0 && l.streams.Load() == 0 && t.load[node] == l {
		delete(t.load, node)
	}
	t.mu.Unlock()
}

// admitStream counts a request of v's node, or answers 503 when the node
// has MaxStreamsPerPeer in flight here across its connections. release
// must be called when the request ends.
func (t *Transport) admitStream(w http.ResponseWriter, v *verified) (release func(), ok bool) {
	if v.load.acquire(t.cfg.MaxStreamsPerPeer) {
		return v.load.release, true
	}
	t.refused(&refusalError{why: RefusedTooManyStreams, node: v.node,
		msg: fmt.Sprintf("node %q has %d requests in flight here (mesh.max_streams_per_peer)", v.node, t.cfg.MaxStreamsPerPeer)}, "")
	w.Header().Set("Retry-After", "1")
	writePeerError(w, http.StatusServiceUnavailable, "service_unavailable", RefusedTooManyStreams,
		"this node has "+strconv.FormatInt(t.cfg.MaxStreamsPerPeer, 10)+" requests of yours in flight; retry shortly")
	return nil, false
}

// readDeadliner is a response writer whose request body has a read
// deadline: HTTP/3's, and any framing of our own over QUIC streams.
type readDeadliner interface {
	SetReadDeadline(time.Time) error
}

// bodyDeadline bounds reading the request body of a peer's stream by
// BodyTimeout: a body that trickles in is cut with a timeout error (the
// proxy answers 408) and the stream is closed when the handler returns.
func (t *Transport) bodyDeadline(w http.ResponseWriter, r *http.Request) {
	if r.Body == nil || r.Body == http.NoBody {
		return
	}
	if d, ok := w.(readDeadliner); ok {
		_ = d.SetReadDeadline(time.Now().Add(t.cfg.BodyTimeout))
	}
}

// headSize is h's field section size as RFC 9114 section 4.2.2 counts it.
func headSize(h http.Header) int {
	n := 0
	for k, vv := range h {
		for _, v := range vv {
			n += len(k) + len(v) + 32
		}
	}
	return n
}

// checkResponseHead drops a response whose head is over MaxHeadBytes. The
// HTTP/3 client refuses such a head itself (MaxResponseHeaderBytes); this
// holds for any transport under RoundTrip.
func checkResponseHead(node string, resp *http.Response) error {
	if n := headSize(resp.Header); n > MaxHeadBytes {
		_ = resp.Body.Close()
		return fmt.Errorf("peer %q: %w (%d bytes)", node, ErrResponseHeadTooLarge, n)
	}
	return nil
}

// headTooLarge reports whether err is the HTTP/3 client's refusal of a
// response head over its limit (a HEADERS frame longer than the limit, or
// fields that decode to more). quic-go has no exported error for either;
// TestTransportRefusesHugeResponseHead pins these messages.
func headTooLarge(err error) bool {
	s := err.Error()
	return strings.Contains(s, "HEADERS frame too large") || strings.Contains(s, "headers too large")
}
