package mesh

import (
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// Round-trip times to peers. memberlist probes one member every
// ProbeInterval and, for a direct ack, tells its PingDelegate how long the
// ping took (Consul builds its network coordinates from the same reports).
// The book keeps a smoothed RTT per peer (RFC 6298's SRTT, gain 1/8) and
// when it was last measured: the time the peer was last heard directly.
// It owns its own lock; nothing else in the Mesh is touched by a ping.

type rttBook struct {
	mu sync.Mutex
	m  map[string]rttSample
}

type rttSample struct {
	srtt time.Duration // smoothed
	last time.Duration // the latest measurement
	at   time.Time     // when it was taken
}

// observe records a measurement of rtt to node at now.
func (b *rttBook) observe(node string, rtt time.Duration, now time.Time) {
	if rtt <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.m == nil {
		b.m = map[string]rttSample{}
	}
	s, ok := b.m[node]
	if ok {
		s.srtt += (rtt - s.srtt) / 8
	} else {
		s.srtt = rtt
	}
	s.last, s.at = rtt, now
	b.m[node] = s
}

// get returns node's smoothed RTT and when it was last measured; zeros
// when never.
func (b *rttBook) get(node string) (time.Duration, time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.m[node]
	return s.srtt, s.at
}

// forget drops node (it left the mesh): the book holds live peers only.
func (b *rttBook) forget(node string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.m, node)
}

// pingDelegate is memberlist's PingDelegate: it fills the RTT book.
type pingDelegate Mesh

var _ memberlist.PingDelegate = (*pingDelegate)(nil)

// AckPayload sends nothing with our acks.
func (*pingDelegate) AckPayload() []byte { return nil }

// NotifyPingComplete records the round trip of a direct probe of other.
func (d *pingDelegate) NotifyPingComplete(other *memberlist.Node, rtt time.Duration, _ []byte) {
	m := (*Mesh)(d)
	if other == nil || other.Name == m.name {
		return
	}
	m.rtt.observe(other.Name, rtt, time.Now())
}

// RTT is the smoothed round-trip time to node, 0 before one is measured
// (or for a node not in the mesh).
func (m *Mesh) RTT(node string) time.Duration {
	rtt, _ := m.rtt.get(node)
	return rtt
}
