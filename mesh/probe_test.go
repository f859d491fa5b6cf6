package mesh

import (
	"context"
	"errors"
	"io"
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

// A peer that answers our other requests but not the probe in time (its
// agent short of CPU under thousands of streams) is slow, not silent:
// ConfirmAlive says ErrPeerSlow while its stream brings data during the
// probe, and a plain timeout once nothing does. The probe's answer is held
// back through the Leaving callback, which the probe handler calls.
func TestConfirmAliveSlowProbeWhileDataFlowsIsSlowNotSilent(t *testing.T) {
	dir := newStaticDir()
	holdProbe := make(chan struct{})
	startNode(t, dir, "b", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := w.Write([]byte("data: x\n\n")); err != nil {
				return
			}
			if rc.Flush() != nil {
				return
			}
			select {
			case <-tick.C:
			case <-r.Context().Done():
				return
			}
		}
	}), func(c *TransportConfig) {
		c.Leaving = func() bool { <-holdProbe; return false }
	})
	a := startNode(t, dir, "a", nil, nil)
	defer close(holdProbe)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := post(ctx, a.tr, "b", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	read := make(chan struct{})
	go func() {
		defer close(read)
		_, _ = io.Copy(io.Discard, resp.Body)
	}()

	pctx, pcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err = a.tr.ConfirmAlive(pctx, "b")
	pcancel()
	if !errors.Is(err, ErrPeerSlow) {
		t.Fatalf("ConfirmAlive with the probe held and b's stream flowing = %v, want ErrPeerSlow", err)
	}

	resp.Body.Close()
	<-read
	pctx, pcancel = context.WithTimeout(ctx, 300*time.Millisecond)
	err = a.tr.ConfirmAlive(pctx, "b")
	pcancel()
	if err == nil || errors.Is(err, ErrPeerSlow) || errors.Is(err, ErrPeerBusy) {
		t.Fatalf("ConfirmAlive with the probe held and nothing flowing = %v, want a plain failure", err)
	}
}
