package mesh

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// dialAs opens a QUIC connection to tr presenting node's certificate (any
// number of them: what an agent never does), closed at cleanup.
func dialAs(t *testing.T, tr *Transport, node string, key ed25519.PrivateKey) *http3.ClientConn {
	t.Helper()
	cert, err := NodeCertificate(node, key)
	if err != nil {
		t.Fatal(err)
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, NextProtos: []string{http3.NextProtoH3}, MinVersion: tls.VersionTLS13}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := quic.DialAddr(ctx, tr.Addr().String(), tc, &quic.Config{KeepAlivePeriod: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.CloseWithError(0, "") })
	return (&http3.Transport{}).NewClientConn(conn)
}

func probeOn(cc *http3.ClientConn) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://b"+probePath, nil)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// TestTransportBoundsConnectionsAndStreamsPerNode: one node's key opens
// three connections where MaxConnsPerPeer is 2, and four requests on each
// open one (as many as one connection allows) where MaxStreamsPerPeer is
// 4: the third connection is closed, the handler holds 4 of the node's
// requests at once across its two connections and the other 4 are
// answered 503 too_many_streams; each refusal is reported once and counted
// every time. The liveness probe is answered whatever the node holds.
func TestTransportBoundsConnectionsAndStreamsPerNode(t *testing.T) {
	dir := newStaticDir()
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	var held, peak atomic.Int64
	b := startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := held.Add(1)
		defer held.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}), func(c *TransportConfig) { c.MaxConnsPerPeer, c.MaxStreamsPerPeer = 2, 4 })
	aKey := newKey(t)
	dir.set("a", dirEntry{key: aKey.Public().(ed25519.PublicKey), admitted: true})

	var conns []*http3.ClientConn
	for i := range 3 {
		cc := dialAs(t, b.tr, "a", aKey)
		err := probeOn(cc)
		switch {
		case i < 2 && err != nil:
			t.Fatalf("connection %d: %v", i+1, err)
		case i == 2 && err == nil:
			t.Fatalf("a third connection from a was served; MaxConnsPerPeer is 2")
		case i < 2:
			conns = append(conns, cc)
		}
	}

	var busy, ok atomic.Int64
	outstanding := make([]atomic.Int64, len(conns)) // per connection: requests not answered yet
	var wg sync.WaitGroup
	defer func() { unblock(); wg.Wait() }() // also when the test fails early
	for i, cc := range conns {
		for range 4 {
			outstanding[i].Add(1)
			wg.Go(func() {
				defer outstanding[i].Add(-1)
				req, _ := http.NewRequest(http.MethodPost, "https://b/v1/chat/completions", strings.NewReader("{}"))
				resp, err := cc.RoundTrip(req)
				if err != nil {
					t.Error(err)
					return
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(string(body), RefusedTooManyStreams):
					busy.Add(1)
				case resp.StatusCode == http.StatusOK:
					ok.Add(1)
				default:
					t.Errorf("status %d %s", resp.StatusCode, body)
				}
			})
		}
	}
	eventually(t, 2*time.Second, "4 held and 4 refused", func() bool { return held.Load() == 4 && busy.Load() == 4 })
	// On a connection with a stream free (the held ones may all be on
	// the other):
	free := conns[0]
	if outstanding[0].Load() == 4 {
		free = conns[1]
	}
	if err := probeOn(free); err != nil {
		t.Errorf("the probe while a holds every request it may: %v", err)
	}
	unblock()
	wg.Wait()
	if peak.Load() != 4 || ok.Load() != 4 {
		t.Errorf("the handler held %d of a's requests at once and served %d, want 4 and 4", peak.Load(), ok.Load())
	}
	got := b.tr.Refusals()
	if got[RefusedTooManyStreams] != 4 || got[RefusedTooManyConns] != 1 {
		t.Errorf("Refusals = %v, want 4 %s and 1 %s", got, RefusedTooManyStreams, RefusedTooManyConns)
	}
	b.refused.mu.Lock()
	seen := append([]string(nil), b.refused.seen...)
	b.refused.mu.Unlock()
	if want := []string{"a/" + RefusedTooManyConns, "a/" + RefusedTooManyStreams}; fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Errorf("reported refusals %v, want %v (each once)", seen, want)
	}
	// The connections' ends are uncounted: a may connect again.
	for _, cc := range conns {
		_ = cc.CloseWithError(0, "")
	}
	eventually(t, 2*time.Second, "a's record dropped", func() bool {
		b.tr.mu.Lock()
		defer b.tr.mu.Unlock()
		return b.tr.load["a"] == nil
	})
	if err := probeOn(dialAs(t, b.tr, "a", aKey)); err != nil {
		t.Errorf("a new connection after the others closed: %v", err)
	}
}

// TestTransportPeerBodyDeadline: a request body that trickles in is cut at
// BodyTimeout with a timeout error, and the stream is closed once the
// handler answered (the sender's writes fail).
func TestTransportPeerBodyDeadline(t *testing.T) {
	dir := newStaticDir()
	readErr := make(chan error, 1)
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		readErr <- err
		w.WriteHeader(http.StatusRequestTimeout)
	}), func(c *TransportConfig) { c.BodyTimeout = 300 * time.Millisecond })
	a := startNode(t, dir, "a", nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pr, pw := io.Pipe()
	context.AfterFunc(ctx, func() { pw.CloseWithError(ctx.Err()) })
	wrote := make(chan error, 1)
	go func() {
		defer pr.Close()
		for {
			if _, err := pw.Write([]byte(" ")); err != nil {
				wrote <- err
				return
			}
			// The trickle is the fault injected (a byte every 50 ms), not
			// a wait for a condition.
			time.Sleep(50 * time.Millisecond)
		}
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://b/v1/chat/completions", pr)
	resp, err := a.tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var ne interface{ Timeout() bool }
	if err := <-readErr; !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("the handler's body read ended with %v, want a timeout", err)
	}
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Errorf("status %d", resp.StatusCode)
	}
	if err := <-wrote; errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("the sender could write on after the answer: the stream was not closed")
	}
}

// TestTransportRefusesHugeResponseHead: a peer's response head over
// MaxHeadBytes is refused with ErrResponseHeadTooLarge, whichever of
// quic-go's checks catches it (the HEADERS frame's length, or the fields
// it decodes to), and checkResponseHead holds any transport to the same.
func TestTransportRefusesHugeResponseHead(t *testing.T) {
	dir := newStaticDir()
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/frame": // a HEADERS frame longer than the limit
			w.Header().Set("X-Big", strings.Repeat("x", 2*MaxHeadBytes))
		case "/fields": // a short frame that decodes to more: indexed static fields
			for range 2200 {
				w.Header().Add("Access-Control-Allow-Headers", "cache-control")
			}
		}
	}), nil)
	a := startNode(t, dir, "a", nil, nil)
	for _, path := range []string{"/frame", "/fields"} {
		req, _ := http.NewRequest(http.MethodGet, "https://b"+path, nil)
		resp, err := a.tr.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		if !errors.Is(err, ErrResponseHeadTooLarge) {
			t.Errorf("%s: RoundTrip err = %v, want ErrResponseHeadTooLarge", path, err)
		}
	}
	big := &http.Response{Header: http.Header{"X-Big": {strings.Repeat("x", MaxHeadBytes)}}, Body: http.NoBody}
	if err := checkResponseHead("b", big); !errors.Is(err, ErrResponseHeadTooLarge) {
		t.Errorf("checkResponseHead(%d bytes) = %v, want ErrResponseHeadTooLarge", MaxHeadBytes, err)
	}
	small := &http.Response{Header: http.Header{"Content-Type": {"application/json"}}, Body: http.NoBody}
	if err := checkResponseHead("b", small); err != nil {
		t.Errorf("checkResponseHead(small) = %v", err)
	}
}
