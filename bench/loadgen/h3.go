package main

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/infermesh/infermesh/mesh"
)

// bareH3 is a bare HTTP/3 exchange, the floor of the remote hop: two
// mesh transports (QUIC, TLS 1.3 with pinned client certificates, as
// between agents) in the load generator's process, the server answering
// a fixed small chat completion. It is the same measurement as the "h3"
// path of BenchmarkRemoteHop (agent/remote_bench_test.go), taken here in
// the same run as the agents. Not safe for concurrent use (do).
type bareH3 struct {
	client, server *mesh.Transport
	cancel         context.CancelFunc
	wg             sync.WaitGroup
	req            []byte
}

// newBareH3 starts both transports on 127.0.0.1; Close stops them.
func newBareH3() (*bareH3, error) {
	dir := mesh.NewStaticDirectory()
	answer := []byte(`{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"demo","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, how are you?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}`)
	ctx, cancel := context.WithCancel(context.Background())
	h := &bareH3{cancel: cancel, req: smallBody("chat")}
	start := func(name string, hd http.Handler) (*mesh.Transport, error) {
		pub, key, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, err
		}
		tr, err := mesh.NewTransport(mesh.TransportConfig{Name: name, Key: key, Listen: "127.0.0.1:0", Peers: dir, Handler: hd})
		if err != nil {
			return nil, err
		}
		dir.Set(name, tr.Addr().String(), pub)
		h.wg.Go(func() { _ = tr.Serve(ctx) })
		return tr, nil
	}
	var err error
	h.server, err = start("h3-server", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	}))
	if err == nil {
		h.client, err = start("h3-client", nil)
	}
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("bare HTTP/3: %w", err)
	}
	return h, nil
}

// do sends one small chat completion and reads the whole answer.
func (h *bareH3) do(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://h3-server/v1/chat/completions", bytes.NewReader(h.req))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := h.client.RoundTrip(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	return err
}

// Close stops both transports and waits for them. Idempotent.
func (h *bareH3) Close() {
	h.cancel()
	h.wg.Wait()
}

// h3LatencyRep runs bare HTTP/3 exchanges one at a time for dur.
func (b *bench) h3LatencyRep(ctx context.Context, h *bareH3, dur time.Duration, record bool) error {
	ctx, cancel := context.WithTimeout(ctx, dur+30*time.Second)
	defer cancel()
	lat := make([]time.Duration, 0, 1<<15)
	start := time.Now()
	deadline := start.Add(dur)
	for {
		t0 := time.Now()
		if err := h.do(ctx); err != nil {
			return err
		}
		t1 := time.Now()
		lat = append(lat, t1.Sub(t0))
		if t1.After(deadline) {
			break
		}
	}
	if record {
		b.h3 = append(b.h3, pcts(lat))
	}
	return nil
}
