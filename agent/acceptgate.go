package agent

import (
	"net"
	"sync"

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

func (l *gatedHandover) HandOver(c net.Conn) error { return l.h.HandOver(c) }

var _ proxy.ConnHandover = (*gatedHandover)(nil)

type gatedListener struct {
	net.Listener
	gate      *acceptGate
	closeOnce sync.Once
	closed    chan struct{}
}

// Accept waits for the gate, then accepts; Close ends the wait.
func (l *gatedListener) Accept() (net.Conn, error) {
	select {
	case <-l.gate.open:
		return l.Listener.Accept()
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *gatedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}
