package proxy

import (
	"context"
	"sync"
	"time"
)

// reqCtx is the context of a request the h1Server serves: cancelled when
// the request ends, the client goes away or the server closes. It carries
// no values and no deadline.
//
// It is cheaper than context.WithCancel for what the proxy does with it:
// its Done channel is made only when asked for, and it has AfterFunc, the
// method context.AfterFunc and the context package's own children use
// when a parent has it, so registering a function costs no children map
// (the upstream client registers one per request, to close the instance
// connection when the client goes away).
//
// Safe for concurrent use.
type reqCtx struct {
	mu    sync.Mutex
	done  chan struct{} // made on demand; closed by cancel
	err   error
	after []*afterFn  // registered, not stopped
	buf   [1]*afterFn // after's first backing array
}

func newReqCtx() *reqCtx {
	c := &reqCtx{}
	c.after = c.buf[:0]
	return c
}

type afterFn struct {
	c *reqCtx
	f func()
}

var (
	_ context.Context = (*reqCtx)(nil)
	_ afterFuncer     = (*reqCtx)(nil)
)

// afterFuncer is how context.AfterFunc recognises a parent that runs
// functions itself.
type afterFuncer interface {
	AfterFunc(f func()) (stop func() bool)
}

// closedChan is the Done channel of a context cancelled before anyone asked.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (c *reqCtx) Deadline() (time.Time, bool) { return time.Time{}, false }

func (c *reqCtx) Value(any) any { return nil }

func (c *reqCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		if c.err != nil {
			return closedChan
		}
		c.done = make(chan struct{})
	}
	return c.done
}

func (c *reqCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// AfterFunc arranges for f to run in its own goroutine once c is
// cancelled (at once if it is). stop unregisters f; it reports whether f
// was stopped before it was started. As context.AfterFunc.
func (c *reqCtx) AfterFunc(f func()) (stop func() bool) {
	a := &afterFn{c: c, f: f}
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	c.after = append(c.after, a)
	c.mu.Unlock()
	return a.stop
}

func (a *afterFn) stop() bool {
	c := a.c
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, b := range c.after {
		if b == a {
			c.after = append(c.after[:i], c.after[i+1:]...)
			return true
		}
	}
	return false
}

// cancel cancels c with context.Canceled and starts the registered
// functions; later calls do nothing.
func (c *reqCtx) cancel() {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = context.Canceled
	if c.done != nil {
		close(c.done)
	}
	after := c.after
	c.after = nil
	c.mu.Unlock()
	for _, a := range after {
		go a.f()
	}
}

// String names the context, as the context package's own do.
func (c *reqCtx) String() string { return "proxy.reqCtx" }
