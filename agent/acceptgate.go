package agent

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"

	"github.com/infermesh/infermesh/proxy"
)

// The role ports are bound early in Run (so that a port taken is an error
// at start, and connections queue in the kernel from then on) but accept
// only once the agent is ready: a restarted agent would otherwise answer
// the connections queued during the restart (systemd keeps the sockets,
// see cmd/infermeshd) before it has joined the mesh, with no instance.

// acceptGate holds Accept on the listeners it wraps until it opens.
type acceptGate struct {
	once sync.Once
	open chan struct{}
}

func newAcceptGate() *acceptGate { return &acceptGate{open: make(chan struct{})} }

// Open lets every wrapped listener accept. Idempotent.
func (g *acceptGate) Open() { g.once.Do(func() { close(g.open) }) }

// listen binds with bind (net.Listen when nil) and wraps the listener.
func (g *acceptGate) listen(bind func(network, addr string) (net.Listener, error)) func(network, addr string) (net.Listener, error) {
	if bind == nil {
		bind = net.Listen
	}
	return func(network, addr string) (net.Listener, error) {
		ln, err := bind(network, addr)
		if err != nil {
			return nil, err
		}
		gl := &gatedListener{Listener: ln, gate: g, closed: make(chan struct{})}
		if h, ok := ln.(proxy.ConnHandover); ok {
			return &gatedHandover{gatedListener: gl, h: h}, nil
		}
		return gl, nil
	}
}

// gatedHandover is a gatedListener whose listener hands idle connections
// over (proxy.ConnHandover), passed through: the wrapper has the method
// only when the listener underneath does.
type gatedHandover struct {
	*gatedListener
	h proxy.ConnHandover
}

func (l *gatedHandover) HandOver(c net.Conn) error {
	if l.retired.Load() {
		return errRetired
	}
	return l.h.HandOver(c)
}

// errRetired refuses to hand over the connections of a retired listener:
// no next agent listens on its port.
var errRetired = errors.New("the port is no longer configured")

// A keptListener's socket outlives the listener: cmd/infermeshd keeps
// it in systemd's file descriptor store for the next agent (Options.Listen).
// Release takes it out of the store for good, so that closing the
// listener closes the port.
type keptListener interface{ Release() }

var _ proxy.ConnHandover = (*gatedHandover)(nil)

type gatedListener struct {
	net.Listener
	gate      *acceptGate
	closeOnce sync.Once
	closed    chan struct{}
	retired   atomic.Bool
}

// retire gives up the port of a listener a reload took away (its role
// removed, or moved to another port) before the proxy drains it: the
// socket leaves systemd's store and closes at once, so that the port is
// free for another role in the same reload, and the idle connections the
// drain ends close rather than go to the next agent. Accept then waits for
// the proxy's own Close, so that its server sees a stop, not a failure.
func (l *gatedListener) retire() {
	l.retired.Store(true)
	if k, ok := l.Listener.(keptListener); ok {
		k.Release()
	}
	_ = l.Listener.Close()
}

// Accept waits for the gate, then accepts; Close ends the wait.
func (l *gatedListener) Accept() (net.Conn, error) {
	select {
	case <-l.gate.open:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil && l.retired.Load() {
		<-l.closed
		return nil, net.ErrClosed
	}
	return c, err
}

func (l *gatedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}
