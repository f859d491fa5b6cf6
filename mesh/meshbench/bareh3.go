package meshbench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"sync"

	"github.com/infermesh/infermesh/mesh"
)

// BareH3 is a bare HTTP/3 exchange, the floor of the remote hop: two mesh
// transports (QUIC, TLS 1.3 with pinned client certificates, as between
// agents) in this process on 127.0.0.1, the server answering every request
// with a fixed small chat completion. The load generator measures it in the
// same run as the agents, and agent's BenchmarkRemoteHop beside its paths.
// Do is safe for concurrent use.
type BareH3 struct {
	client, server *mesh.Transport
	cancel         context.CancelFunc
	wg             sync.WaitGroup
	closeOnce      sync.Once
}

// bareH3Answer is the server's fixed answer.
var bareH3Answer = []byte(`{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"demo","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, how are you?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}`)

// NewBareH3 starts both transports; Close stops them.
func NewBareH3() (*BareH3, error) {
	dir := mesh.NewStaticDirectory()
	ctx, cancel := context.WithCancel(context.Background())
	h := &BareH3{cancel: cancel}
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
		_, _ = w.Write(bareH3Answer)
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

// Do posts body as a chat completion and reads the whole answer.
func (h *BareH3) Do(ctx context.Context, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://h3-server/v1/chat/completions", bytes.NewReader(body))
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
		err = fmt.Errorf("bare HTTP/3: status %d", resp.StatusCode)
	}
	return err
}

// Close stops both transports and waits for them. Idempotent.
func (h *BareH3) Close() {
	h.closeOnce.Do(func() {
		h.cancel()
		h.wg.Wait()
	})
}
