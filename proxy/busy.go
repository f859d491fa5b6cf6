package proxy

import (
	"sync"
	"sync/atomic"
)

// busyCounts counts, per role, the requests this node's local instance is
// serving right now (for local apps and for peers alike): the load this
// node advertises for the role.
type busyCounts struct{ m sync.Map } // role -> *atomic.Int64

// add counts one request for role until the returned func is called.
func (b *busyCounts) add(role string) func() {
	v, ok := b.m.Load(role)
	if !ok {
		v, _ = b.m.LoadOrStore(role, new(atomic.Int64))
	}
	n := v.(*atomic.Int64)
	n.Add(1)
	return func() { n.Add(-1) }
}

func (b *busyCounts) get(role string) int64 {
	if v, ok := b.m.Load(role); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

// LocalInFlight is how many requests for role this node's local instance
// is serving right now, from the moment one is sent to it until its
// response ends (streams included), for local apps and peers alike.
func (p *Proxy) LocalInFlight(role string) int64 { return p.busy.get(role) }
