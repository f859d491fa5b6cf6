package mesh

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"
)

// A probe to a peer on whose connection every stream the peer allows is
// held by our own requests cannot be sent; ConfirmAlive says so
// (ErrPeerBusy) rather than reporting a silence it never observed. Once a
// stream is free the probe is answered.
func TestConfirmAliveAtStreamLimitIsBusyNotSilent(t *testing.T) {
	dir := newStaticDir()
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-release
	}), func(c *TransportConfig) { c.MaxStreamsPerPeer = 1 })
	a := startNode(t, dir, "a", nil, nil)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	held := make(chan error, 1)
	go func() {
		resp, err := post(ctx, a.tr, "b", `{}`)
		if err == nil {
			resp.Body.Close()
		}
		held <- err
	}()
	<-started // b holds a's only stream

	pctx, pcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := a.tr.ConfirmAlive(pctx, "b")
	pcancel()
	if !errors.Is(err, ErrPeerBusy) {
		t.Fatalf("ConfirmAlive with b's only stream held = %v, want ErrPeerBusy", err)
	}

	close(release)
	if err := <-held; err != nil {
		t.Fatalf("the request holding the stream: %v", err)
	}
	if err := a.tr.ConfirmAlive(ctx, "b"); err != nil {
		t.Fatalf("ConfirmAlive once the stream is free = %v, want nil", err)
	}
}
