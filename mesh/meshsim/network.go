// Package meshsim runs many mesh nodes in one process over an in-memory
// network with configurable latency and loss, to measure what a real fleet
// of that size would see: membership formation, advert propagation, gossip
// bytes per node per second (adverts and membership apart) and memory per
// node. Real meshes (mesh.New, real keys, certificates, signatures and the
// encrypted gossip) run over it; only the sockets are simulated.
//
// It asserts no speed: callers (bench/loadgen, the tests) report what it
// measures.
package meshsim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/internal/defaults"
)

// ErrNoRoute is returned for a dial or packet to an address no live
// transport has.
var ErrNoRoute = errors.New("meshsim: no route")

// DefaultQueueLen is a transport's packet queue when Network.QueueLen is 0:
// packets arriving at a full queue are dropped, like datagrams at a full
// socket buffer (counted in Stats.Overflows).
const DefaultQueueLen = 1024

// Network is an in-memory network joining Transports. Configure it before
// the first NewTransport; its methods are safe for concurrent use.
type Network struct {
	// Latency is the one-way delay of every packet and of opening a stream
	// (a stream's data then flows at once). Jitter adds a uniform random
	// delay in [0, Jitter) per packet.
	Latency time.Duration
	Jitter  time.Duration
	// Loss is the probability that a packet is dropped (streams are
	// reliable, as TCP is).
	Loss float64
	// QueueLen is each transport's packet queue. Default DefaultQueueLen.
	QueueLen int

	mu    sync.RWMutex
	nodes map[string]*Transport
	next  int

	lost, overflows atomic.Uint64
}

// Stats are a network's drop counters.
type Stats struct {
	// Lost packets were dropped by Loss.
	Lost uint64
	// Overflows were dropped at a full receive queue (a node too slow to
	// keep up).
	Overflows uint64
}

// Stats returns the drop counters since the network was made.
func (n *Network) Stats() Stats {
	return Stats{Lost: n.lost.Load(), Overflows: n.overflows.Load()}
}

// NewTransport returns a transport with a fresh address (10.x.y.z:7946).
func (n *Network) NewTransport() *Transport {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.next++
	i := n.next
	ip := net.IPv4(10, byte(i>>16), byte(i>>8), byte(i))
	q := n.QueueLen
	defaults.Positive(&q, DefaultQueueLen)
	t := &Transport{
		net:      n,
		addr:     &net.UDPAddr{IP: ip, Port: 7946},
		packetCh: make(chan *memberlist.Packet, q),
		streamCh: make(chan net.Conn),
		done:     make(chan struct{}),
	}
	t.key = t.addr.String()
	if n.nodes == nil {
		n.nodes = map[string]*Transport{}
	}
	n.nodes[t.key] = t
	return t
}

func (n *Network) lookup(addr string) (*Transport, error) {
	n.mu.RLock()
	t := n.nodes[addr]
	n.mu.RUnlock()
	if t == nil || t.closed.Load() {
		return nil, fmt.Errorf("%w to %s", ErrNoRoute, addr)
	}
	return t, nil
}

func (n *Network) delay() time.Duration {
	d := n.Latency
	if n.Jitter > 0 {
		d += rand.N(n.Jitter)
	}
	return d
}

// Transport is one node's end of a Network; it implements memberlist's
// NodeAwareTransport.
type Transport struct {
	net      *Network
	addr     *net.UDPAddr
	key      string
	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	done     chan struct{}
	closed   atomic.Bool
	once     sync.Once

	sent atomic.Uint64 // bytes written: packets and streams
}

var _ memberlist.NodeAwareTransport = (*Transport)(nil)

// Addr is the transport's address.
func (t *Transport) Addr() string { return t.key }

// BytesSent is every byte this transport wrote (packets and streams).
func (t *Transport) BytesSent() uint64 { return t.sent.Load() }

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *Transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	return t.addr.IP, t.addr.Port, nil
}

// WriteTo implements memberlist.Transport.
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport: the packet
// arrives after the network's delay unless lost or the receiver's queue
// is full. Like UDP, a packet to an address nobody has is lost silently.
func (t *Transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	now := time.Now()
	if t.closed.Load() {
		return now, net.ErrClosed
	}
	t.sent.Add(uint64(len(b)))
	n := t.net
	if n.Loss > 0 && rand.Float64() < n.Loss {
		n.lost.Add(1)
		return now, nil
	}
	dest, err := n.lookup(a.Addr)
	if err != nil {
		return now, nil
	}
	p := &memberlist.Packet{Buf: append([]byte(nil), b...), From: t.addr}
	deliver := func() {
		p.Timestamp = time.Now()
		select {
		case dest.packetCh <- p:
		default:
			n.overflows.Add(1)
		}
	}
	if d := n.delay(); d > 0 {
		time.AfterFunc(d, deliver)
	} else {
		deliver()
	}
	return now, nil
}

// PacketCh implements memberlist.Transport.
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packetCh }

// DialTimeout implements memberlist.Transport.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport: a
// synchronous in-memory stream (net.Pipe), handed to the other side after
// the network's latency.
func (t *Transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	if t.closed.Load() {
		return nil, net.ErrClosed
	}
	dest, err := t.net.lookup(a.Addr)
	if err != nil {
		return nil, err
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	if d := t.net.Latency; d > 0 {
		select {
		case <-time.After(d):
		case <-deadline.C:
			return nil, fmt.Errorf("meshsim: dial %s: timeout", a.Addr)
		case <-t.done:
			return nil, net.ErrClosed
		}
	}
	ours, theirs := net.Pipe()
	select {
	case dest.streamCh <- &conn{Conn: theirs, local: dest.addr, remote: t.addr, sent: &dest.sent}:
		return &conn{Conn: ours, local: t.addr, remote: dest.addr, sent: &t.sent}, nil
	case <-deadline.C:
	case <-dest.done:
	case <-t.done:
	}
	ours.Close()
	theirs.Close()
	return nil, fmt.Errorf("meshsim: dial %s: not accepted", a.Addr)
}

// StreamCh implements memberlist.Transport.
func (t *Transport) StreamCh() <-chan net.Conn { return t.streamCh }

// Shutdown implements memberlist.Transport: the address stops answering.
func (t *Transport) Shutdown() error {
	t.once.Do(func() {
		t.closed.Store(true)
		close(t.done)
	})
	return nil
}

// conn is one end of a stream, counting what its owner writes.
type conn struct {
	net.Conn
	local, remote net.Addr
	sent          *atomic.Uint64
}

func (c *conn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.sent.Add(uint64(n))
	return n, err
}

func (c *conn) LocalAddr() net.Addr  { return c.local }
func (c *conn) RemoteAddr() net.Addr { return c.remote }
