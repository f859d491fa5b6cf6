package mesh

import (
	"crypto/ed25519"
	"sync"
)

// StaticDirectory is a PeerDirectory from a fixed table of nodes: for a
// transport used without gossip (benchmarks, tools, tests). Every listed
// node is admitted and trusted with exactly its listed key. Safe for
// concurrent use.
type StaticDirectory struct {
	mu    sync.RWMutex
	nodes map[string]staticPeer
}

type staticPeer struct {
	addr string
	key  ed25519.PublicKey
}

var _ PeerDirectory = (*StaticDirectory)(nil)

// NewStaticDirectory returns an empty directory.
func NewStaticDirectory() *StaticDirectory {
	return &StaticDirectory{nodes: map[string]staticPeer{}}
}

// Set lists node at QUIC address addr with key, replacing any entry.
func (d *StaticDirectory) Set(node, addr string, key ed25519.PublicKey) {
	d.mu.Lock()
	d.nodes[node] = staticPeer{addr: addr, key: key}
	d.mu.Unlock()
}

// Remove drops node: it is no longer admitted or trusted.
func (d *StaticDirectory) Remove(node string) {
	d.mu.Lock()
	delete(d.nodes, node)
	d.mu.Unlock()
}

func (d *StaticDirectory) get(node string) (staticPeer, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	p, ok := d.nodes[node]
	return p, ok
}

// PeerAddr implements PeerDirectory.
func (d *StaticDirectory) PeerAddr(node string) (string, bool) {
	p, ok := d.get(node)
	return p.addr, ok && p.addr != ""
}

// PeerKey implements PeerDirectory.
func (d *StaticDirectory) PeerKey(node string) (ed25519.PublicKey, bool) {
	p, ok := d.get(node)
	return p.key, ok
}

// IsAdmitted implements PeerDirectory.
func (d *StaticDirectory) IsAdmitted(node string) bool {
	_, ok := d.get(node)
	return ok
}

// TrustsKey implements PeerDirectory.
func (d *StaticDirectory) TrustsKey(node string, key ed25519.PublicKey) bool {
	p, ok := d.get(node)
	return ok && p.key.Equal(key)
}
