package mesh

import (
	"bytes"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/placement"
)

// The memberlist delegates are distinct types over the same Mesh so that
// their methods do not become part of Mesh's API. memberlist calls several
// of them (alive, events, conflict) with its node lock held: they must
// never call back into memberlist, and they only take the Mesh's own locks.

type (
	delegate         Mesh
	events           Mesh
	aliveDelegate    Mesh
	mergeDelegate    Mesh
	conflictDelegate Mesh
)

var (
	_ memberlist.Delegate         = (*delegate)(nil)
	_ memberlist.EventDelegate    = (*events)(nil)
	_ memberlist.AliveDelegate    = (*aliveDelegate)(nil)
	_ memberlist.MergeDelegate    = (*mergeDelegate)(nil)
	_ memberlist.ConflictDelegate = (*conflictDelegate)(nil)
)

// NodeMeta returns our signed node meta.
func (d *delegate) NodeMeta(limit int) []byte {
	b := *(*Mesh)(d).meta.Load()
	if len(b) > limit {
		// Cannot happen: New checked the size against MetaMaxSize.
		return nil
	}
	return b
}

// NotifyMsg receives gossiped adverts. The buffer is reused by memberlist
// after the call: handleAdvert copies what it keeps.
func (d *delegate) NotifyMsg(b []byte) {
	m := (*Mesh)(d)
	if len(b) == 0 {
		return
	}
	switch b[0] {
	case msgAdvert:
		m.handleAdvert(b, true)
	case msgDigest:
		m.handleDigest(b)
	case msgRevocation:
		m.handleRevocationMsg(b, "gossip")
	default:
		m.refuse(auditAdvertRefused, "", "", reasonMalformed, fmt.Sprintf("unknown message type %d", b[0]))
	}
}

// GetBroadcasts hands memberlist the queued adverts.
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte {
	bs := d.bcast.GetBroadcasts(overhead, limit)
	if len(bs) > 0 {
		var n int
		for _, b := range bs {
			n += overhead + len(b)
		}
		d.stats.advertBroadcastBytes.Add(uint64(n))
		d.stats.advertPiggybacks.Add(1)
	}
	return bs
}

// LocalState is our side of a push/pull: every fresh advert we hold, then
// every signed revocation statement.
func (d *delegate) LocalState(join bool) []byte {
	b := (*Mesh)(d).localState()
	d.stats.advertStateBytes.Add(uint64(len(b)))
	return b
}

// MergeRemoteState takes the adverts and revocation statements of the
// other side of a push/pull.
func (d *delegate) MergeRemoteState(buf []byte, join bool) {
	if hook := testHookMergeRemoteState.Load(); hook != nil {
		(*hook)((*Mesh)(d))
	}
	(*Mesh)(d).mergeState(buf)
	(*Mesh)(d).merged.Store(true)
}

// testHookMergeRemoteState, when set by a test, runs before a push/pull's
// state is merged: memberlist has already marked the other side alive.
var testHookMergeRemoteState atomic.Pointer[func(*Mesh)]

// NotifyJoin records an admitted peer.
func (e *events) NotifyJoin(n *memberlist.Node) {
	(*Mesh)(e).setGossipLive(n.Name, n.Address())
	(*Mesh)(e).upsertPeer(n)
}

// NotifyUpdate records a peer's new meta.
func (e *events) NotifyUpdate(n *memberlist.Node) {
	(*Mesh)(e).setGossipLive(n.Name, n.Address())
	(*Mesh)(e).upsertPeer(n)
}

// setGossipLive records memberlist's view of a peer: addr "" when gossip
// says it left or died.
func (m *Mesh) setGossipLive(name, addr string) {
	if name == m.name {
		return
	}
	m.mu.Lock()
	_, was := m.gossipLive[name]
	if addr == "" {
		delete(m.gossipLive, name)
	} else {
		m.gossipLive[name] = addr
	}
	if was != (addr != "") {
		m.liveXor ^= nameHash(name)
		m.liveEvents.Add(1)
	}
	// Only a peer we knew before is back (see peerBack). A first sighting
	// is not: the new node got every advert its join contact held in the
	// join's push/pull, and membership anti-entropy repairs what gossip
	// missed. (A push/pull with each first-seen peer cost N-1 full-state
	// push/pulls per node while a fleet formed.)
	known := m.peers[name] != nil || m.departed[name] != nil
	m.mu.Unlock()
	if addr != "" && !was && known {
		select {
		case m.back <- name:
		default: // the loop has a backlog; it re-sends to everyone in it
		}
	}
}

// NotifyLeave hears gossip say a peer left or was declared dead. Gossip is
// not proof (any gossip key holder can say it): with a Confirmer the peer
// is asked over QUIC first, and forgotten, with everything it advertised,
// only when it does not answer (see peerGone).
func (e *events) NotifyLeave(n *memberlist.Node) {
	m := (*Mesh)(e)
	if n.Name == m.name {
		return
	}
	m.setGossipLive(n.Name, "")
	m.rtt.forget(n.Name)
	m.mu.RLock()
	p := m.peers[n.Name]
	m.mu.RUnlock()
	if p == nil {
		return
	}
	// memberlist hands over the node as it was before the change, so its
	// State does not tell a leave from a death here.
	m.peerGone(p)
}

// Audit kinds of membership changes.
const (
	AuditPeerJoined = "mesh.peer.joined"
	AuditPeerGone   = "mesh.peer.gone"
)

// auditMembership records a join or a leave. The sink must not block (it
// may be called with the advert lock held, like every sink call).
func (m *Mesh) auditMembership(kind, peer string, fields map[string]string) {
	if m.cfg.Audit != nil {
		m.cfg.Audit.Audit(placement.AuditEvent{Kind: kind, Node: peer, Fields: fields})
	}
}

func (m *Mesh) upsertPeer(n *memberlist.Node) {
	if n.Name == m.name {
		return
	}
	meta, err := m.metaCache.parse(n.Name, n.Meta)
	if err != nil {
		// The alive delegate already refused it; memberlist only notifies
		// accepted nodes, so this is a node admitted before a meta change
		// we cannot read. Forget it.
		m.log.Warn("peer meta unreadable", zap.String("peer", n.Name), zap.Error(err))
		return
	}
	m.mu.Lock()
	certOK := m.trust.certOK(meta.cert)
	old, had := m.peers[n.Name]
	if had {
		m.unindexKeyLocked(old)
	}
	m.peers[n.Name] = &peer{name: n.Name, addr: n.Address(), meta: meta, certOK: certOK}
	m.peerKeys[string(meta.key)] = append(m.peerKeys[string(meta.key)], n.Name)
	delete(m.departed, n.Name)
	m.members.Store(int64(len(m.peers) + 1))
	m.mu.Unlock()
	m.releaseEarly(n.Name)
	if !had {
		m.log.Info("peer joined", zap.String("peer", n.Name), zap.String("addr", n.Address()))
		m.auditMembership(AuditPeerJoined, n.Name, map[string]string{"addr": n.Address()})
	}
}

// NotifyAlive refuses nodes that are not admitted, from another cluster, or
// whose name or key is already taken.
func (a *aliveDelegate) NotifyAlive(n *memberlist.Node) error {
	m := (*Mesh)(a)
	why, detail := m.checkIdentity(n)
	if why == "" && n.Name != m.name {
		meta, _ := m.metaCache.parse(n.Name, n.Meta)
		m.mu.RLock()
		t := m.trust
		m.mu.RUnlock()
		if s, w := t.admit(n.Name, meta.key, meta.cert, t.certOK(meta.cert), m.cfg.Now()); s == 0 {
			why, detail = reasonUnadmitted, w
		}
	}
	if why == "" {
		if n.Name != m.name {
			m.refusedNodes.forget(n.Name)
		}
		return nil
	}
	if why == reasonUnadmitted {
		m.refusedNodes.note(m, n, detail) // detail is the admission reason
	} else {
		m.refusedNodes.note(m, n, why)
	}
	m.refuse(auditNodeRefused, n.Name, "", why, detail)
	return fmt.Errorf("%s: %s", why, detail)
}

// unindexKeyLocked removes p from peerKeys. m.mu must be held for writing.
func (m *Mesh) unindexKeyLocked(p *peer) {
	k := string(p.meta.key)
	names := slices.DeleteFunc(m.peerKeys[k], func(n string) bool { return n == p.name })
	if len(names) == 0 {
		delete(m.peerKeys, k)
	} else {
		m.peerKeys[k] = names
	}
}

// checkIdentity checks n's meta, cluster, and that its name and key do not
// collide with this node or another live peer. It returns the refusal
// reason and detail, or "" when fine.
func (m *Mesh) checkIdentity(n *memberlist.Node) (string, string) {
	meta, err := m.metaCache.parse(n.Name, n.Meta)
	if err != nil {
		return reasonBadMeta, err.Error()
	}
	if meta.cluster != m.cfg.Cluster {
		return reasonWrongCluster, fmt.Sprintf("node %q is in cluster %q, we are in %q", n.Name, meta.cluster, m.cfg.Cluster)
	}
	if n.Name == m.name {
		if !meta.key.Equal(m.pub) {
			return reasonNameConflict, fmt.Sprintf("another node with a different key calls itself %q (this node's name)", n.Name)
		}
		return "", ""
	}
	if meta.key.Equal(m.pub) {
		return reasonKeyConflict, fmt.Sprintf("node %q uses this node's (%q) key: a copied state dir?", n.Name, m.name)
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if p := m.peers[n.Name]; p != nil && !p.meta.key.Equal(meta.key) {
		return reasonNameConflict, fmt.Sprintf("node name %q is already used by a live node with another key (at %s)", n.Name, p.addr)
	}
	for _, other := range m.peerKeys[string(meta.key)] {
		if other != n.Name {
			return reasonKeyConflict, fmt.Sprintf("node %q uses the key of live node %q: a copied state dir?", n.Name, other)
		}
	}
	return "", ""
}

// NotifyMerge refuses a join when the other side is another cluster or
// would bring a name or key collision. Both sides of a join run it, so both
// see the error.
func (d *mergeDelegate) NotifyMerge(peers []*memberlist.Node) error {
	m := (*Mesh)(d)
	for _, n := range peers {
		if n.State != memberlist.StateAlive && n.State != memberlist.StateSuspect {
			continue
		}
		why, detail := m.checkIdentity(n)
		if why == "" && n.Name == m.name && n.Address() != m.selfAddr() {
			why, detail = reasonNameConflict, fmt.Sprintf("a live node at %s already uses this node's name %q and key", n.Address(), m.name)
		}
		if why == "" {
			continue
		}
		m.refuse(auditNodeRefused, n.Name, "", why, "join: "+detail)
		err := fmt.Errorf("%s: %s", why, detail)
		// A live entry with our own name and key is this node before a
		// restart, not yet declared dead: retrying will succeed. Every other
		// conflict needs an operator.
		restart := why == reasonNameConflict && n.Name == m.name && m.selfKeyed(n)
		if why != reasonBadMeta && !restart {
			m.joinRefusal.Store(&err)
		}
		return err
	}
	return nil
}

// selfKeyed reports whether n carries our own key (a restart of this node
// that the cluster has not yet declared dead: worth retrying).
func (m *Mesh) selfKeyed(n *memberlist.Node) bool {
	meta, err := m.metaCache.parse(n.Name, n.Meta)
	return err == nil && meta.key.Equal(m.pub)
}

func (m *Mesh) selfAddr() string {
	if p := m.selfAddrCache.Load(); p != nil {
		return *p
	}
	return ""
}

// NotifyConflict audits two live nodes claiming one name.
func (c *conflictDelegate) NotifyConflict(existing, other *memberlist.Node) {
	m := (*Mesh)(c)
	m.refuse(auditNodeRefused, other.Name, "", reasonNameConflict,
		fmt.Sprintf("node name %q is used at %s and %s", other.Name, existing.Address(), other.Address()))
}

// metaCache remembers parsed, self-signature-verified node meta so that the
// alive messages gossip repeats are not verified again and again. It is
// looked up by name and compared byte for byte, so a hit allocates
// nothing (two to three lookups per alive message and push/pull entry).
type metaCache struct {
	mu sync.Mutex
	m  map[string][]metaEntry // by node name, most recent first
	n  int                    // entries over all names
}

type metaEntry struct {
	raw []byte
	nm  *nodeMeta
}

const (
	metaCacheMax = 4096
	// metaPerName bounds the metas kept per name: a node's current and
	// previous ones, and a conflicting node's.
	metaPerName = 4
)

func (c *metaCache) init() { c.m = map[string][]metaEntry{} }

func (c *metaCache) parse(name string, b []byte) (*nodeMeta, error) {
	c.mu.Lock()
	for _, e := range c.m[name] {
		if bytes.Equal(e.raw, b) {
			c.mu.Unlock()
			return e.nm, nil
		}
	}
	c.mu.Unlock()
	nm, err := parseMeta(name, b)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.n >= metaCacheMax {
		clear(c.m)
		c.n = 0
	}
	es := c.m[name]
	if len(es) >= metaPerName {
		es = es[:metaPerName-1]
		c.n--
	}
	c.m[name] = append([]metaEntry{{raw: bytes.Clone(b), nm: nm}}, es...)
	c.n++
	c.mu.Unlock()
	return nm, nil
}
