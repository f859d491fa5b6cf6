package proxy

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestReqCtx checks the h1Server's request context against the contract
// of context.Context and context.AfterFunc.
func TestReqCtx(t *testing.T) {
	wait := func(t *testing.T, ch <-chan struct{}, what string) {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s never happened", what)
		}
	}
	c := newReqCtx()
	if c.Err() != nil {
		t.Fatalf("Err before cancel = %v", c.Err())
	}
	ran := make(chan struct{})
	stopped := make(chan struct{}, 1)
	c.AfterFunc(func() { close(ran) })
	stop := c.AfterFunc(func() { stopped <- struct{}{} })
	if !stop() {
		t.Error("stop before cancel = false, want true")
	}
	if stop() {
		t.Error("second stop = true, want false")
	}
	child, cancelChild := context.WithCancel(c) // through AfterFunc: c has no cancelCtx inside
	defer cancelChild()
	viaPkg := make(chan struct{})
	context.AfterFunc(c, func() { close(viaPkg) })
	done := c.Done()
	select {
	case <-done:
		t.Fatal("Done closed before cancel")
	default:
	}

	c.cancel()
	c.cancel() // idempotent
	wait(t, done, "Done closing")
	wait(t, ran, "the registered function")
	wait(t, child.Done(), "the child's cancellation")
	wait(t, viaPkg, "context.AfterFunc's function")
	if !errors.Is(c.Err(), context.Canceled) || !errors.Is(child.Err(), context.Canceled) {
		t.Errorf("Err = %v, child %v; want context.Canceled", c.Err(), child.Err())
	}
	select {
	case <-stopped:
		t.Error("a stopped function ran")
	default:
	}

	late := make(chan struct{})
	if c.AfterFunc(func() { close(late) })() {
		t.Error("stop after cancel = true, want false")
	}
	wait(t, late, "a function registered after cancel")

	// Done asked for the first time after cancel is closed too.
	c2 := newReqCtx()
	c2.cancel()
	wait(t, c2.Done(), "Done of a context cancelled before it was asked for")
}
