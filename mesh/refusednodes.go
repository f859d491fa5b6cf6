package mesh

import (
	"cmp"
	"crypto/ed25519"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Refused nodes. A node the alive delegate turns away never becomes a
// member, so `peers` would not show it at all; the mesh remembers the last
// refusal of each (bounded), for the operator and so that lifting a
// revocation can contact the node at once.

// RefusedNode is a node refused membership, as last seen.
type RefusedNode struct {
	Name       string
	GossipAddr string
	PublicKey  ed25519.PublicKey // the key it presented, nil when its meta was unreadable
	Why        string            // refusal reason (revoked, not_trusted, certificate_expired, ...)
	LastSeen   time.Time
	Count      uint64
}

const maxRefusedNodes = 256

type refusedNodes struct {
	mu sync.Mutex
	m  map[string]*RefusedNode // by name
}

// note records a refusal of n. Called from the alive and merge delegates:
// it takes only its own lock.
func (r *refusedNodes) note(m *Mesh, n *memberlist.Node, why string) {
	var key ed25519.PublicKey
	if meta, err := m.metaCache.parse(n.Name, n.Meta); err == nil {
		key = meta.key
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[string]*RefusedNode{}
	}
	e := r.m[n.Name]
	if e == nil {
		if len(r.m) >= maxRefusedNodes {
			var oldest string
			for k, v := range r.m {
				if oldest == "" || v.LastSeen.Before(r.m[oldest].LastSeen) {
					oldest = k
				}
			}
			delete(r.m, oldest)
		}
		e = &RefusedNode{Name: n.Name}
		r.m[n.Name] = e
	}
	e.GossipAddr, e.PublicKey, e.Why, e.LastSeen = n.Address(), key, why, time.Now()
	e.Count++
}

// forget drops name (it became a member).
func (r *refusedNodes) forget(name string) {
	r.mu.Lock()
	delete(r.m, name)
	r.mu.Unlock()
}

// RefusedNodes lists the nodes refused membership that are not members
// now, most recently seen first.
func (m *Mesh) RefusedNodes() []RefusedNode {
	m.refusedNodes.mu.Lock()
	out := make([]RefusedNode, 0, len(m.refusedNodes.m))
	for _, e := range m.refusedNodes.m {
		out = append(out, *e)
	}
	m.refusedNodes.mu.Unlock()
	slices.SortFunc(out, func(a, b RefusedNode) int {
		if c := b.LastSeen.Compare(a.LastSeen); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	return out
}

// contactRefused contacts, at once, the refused nodes that trust may admit
// now (after Unrevoke or a trust change), rather than waiting until they
// gossip again or push/pull with us: those no longer revoked that are
// statically trusted with the key they presented, or whose only fault was
// being revoked. Their alive message is checked as usual when it comes.
func (m *Mesh) contactRefused() {
	m.mu.RLock()
	t := m.trust
	m.mu.RUnlock()
	var addrs []string
	for _, e := range m.RefusedNodes() {
		if e.PublicKey == nil || e.GossipAddr == "" || t.revoked(e.Name, e.PublicKey) {
			continue
		}
		if s, ok := t.static[e.Name]; (ok && s.PublicKey.Equal(e.PublicKey)) || (!ok && e.Why == whyRevoked) {
			addrs = append(addrs, e.GossipAddr)
		}
	}
	if len(addrs) == 0 {
		return
	}
	m.spawn(func() {
		if _, err := m.ml.Join(addrs); err != nil {
			m.log.Debug("contacting nodes admitted again", zap.Strings("addrs", addrs), zap.Error(err))
		}
	})
}
