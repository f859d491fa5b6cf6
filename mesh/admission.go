package mesh

import (
	"crypto/ed25519"
	"fmt"
	"slices"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/placement"
)

// scopeOf returns node's scope now, or 0 and why it is not admitted. This
// node is admitted by definition, with selfScope.
func (m *Mesh) scopeOf(node string) (identity.Scope, string, *peer) {
	if node == m.name {
		return m.selfScope(), "", nil
	}
	m.mu.RLock()
	p, t := m.peers[node], m.trust
	certOK := p != nil && p.certOK // SetTrust rewrites certOK under the lock
	m.mu.RUnlock()
	if p == nil {
		return 0, "unknown_node", nil
	}
	s, why := t.admit(node, p.meta.key, p.meta.cert, certOK, m.cfg.Now())
	return s, why, p
}

// selfScope is this node's own scope as the others will see it: its static
// trust entry if our trust lists us, else its certificate's, else full.
func (m *Mesh) selfScope() identity.Scope {
	m.mu.RLock()
	t := m.trust
	m.mu.RUnlock()
	if s, ok := t.static[m.name]; ok && s.PublicKey.Equal(m.pub) {
		return s.Scope
	}
	if m.cert != nil {
		return m.cert.Scope
	}
	return identity.ScopeFull
}

// IsAdmitted reports whether node is a live member admitted right now (any
// scope): not revoked, vouched for by static trust or an unexpired
// certificate. It implements placement.Admission and never blocks.
func (m *Mesh) IsAdmitted(node string) bool {
	s, _, _ := m.scopeOf(node)
	return s != 0
}

// MayServe reports whether node is admitted right now with identity.ScopeFull.
func (m *Mesh) MayServe(node string) bool {
	s, _, _ := m.scopeOf(node)
	return s == identity.ScopeFull
}

// PeerAddr returns the QUIC address an admitted peer advertised.
func (m *Mesh) PeerAddr(node string) (string, bool) {
	s, _, p := m.scopeOf(node)
	if s == 0 || p == nil || p.meta.quicAddr == "" {
		return "", false
	}
	return p.meta.quicAddr, true
}

// PeerKey returns the identity key of an admitted peer, to pin its QUIC
// certificate to.
func (m *Mesh) PeerKey(node string) (ed25519.PublicKey, bool) {
	s, _, p := m.scopeOf(node)
	if s == 0 || p == nil {
		return nil, false
	}
	return p.meta.key, true
}

// TrustsKey reports whether node, identified by key, is vouched for right
// now: not revoked, key unchanged, admitted by static trust or an unexpired
// certificate. Unlike PeerKey it does not require node to be a live gossip
// member: a peer that memberlist declared dead (perhaps falsely, under load)
// but whose QUIC connection is alive keeps it; liveness is the transport's
// keep-alive's business. Never blocks.
func (m *Mesh) TrustsKey(node string, key ed25519.PublicKey) bool {
	s, known := m.lastKnownScope(node)
	return s != 0 && known.Equal(key)
}

// Trusted reports whether node is vouched for right now (any scope) on the
// node meta it last gossiped, whether it is a live member or left: the
// serving side's question about a peer whose QUIC connection proved its
// key. A peer restarting (its new incarnation already asking, gossip still
// recording the old one's leave) is Trusted; so is one gossip falsely
// called dead. A node never seen in gossip is not (its admission
// certificate travels in its node meta). It implements
// placement.Admission and never blocks.
func (m *Mesh) Trusted(node string) bool {
	s, _ := m.lastKnownScope(node)
	return s != 0
}

// lastKnownScope admits node on its last known node meta, live or
// departed: its scope (0 when not admitted or never seen) and the key it
// is known by.
func (m *Mesh) lastKnownScope(node string) (identity.Scope, ed25519.PublicKey) {
	m.mu.RLock()
	p, t := m.peers[node], m.trust
	if p == nil {
		p = m.departed[node]
	}
	var (
		meta   *nodeMeta
		certOK bool
	)
	if p != nil {
		meta, certOK = p.meta, p.certOK // SetTrust rewrites certOK under the lock
	}
	m.mu.RUnlock()
	if meta == nil {
		return 0, nil
	}
	s, _ := t.admit(node, meta.key, meta.cert, certOK, m.cfg.Now())
	return s, meta.key
}

// SetTrust replaces the trust configuration (on reload). Run-time
// revocations (Revoke) stay, and so do the signed statements held that one
// of the new authorities signed. Peers no longer admitted are removed from
// placement at once.
func (m *Mesh) SetTrust(c TrustConfig) error {
	m.mu.Lock()
	t, err := newTrustState(c, m.trust.runtime)
	if err != nil {
		m.mu.Unlock()
		return fmt.Errorf("trust config: %w", err)
	}
	t = m.reverifyRevocationsLocked(t)
	m.trust = t
	for _, p := range m.peers {
		p.certOK = t.certOK(p.meta.cert)
	}
	for _, p := range m.departed {
		p.certOK = t.certOK(p.meta.cert)
	}
	m.mu.Unlock()
	m.enforceAdmission()
	m.contactRefused()
	return nil
}

// Revoke revokes a node name or a base64 public key at once, until
// Unrevoke: the node stops resolving, its adverts are forgotten and its
// gossip is ignored. Run-time revocations are not persisted here; the
// caller keeps them across restarts.
func (m *Mesh) Revoke(nameOrKey string) error {
	r, err := parseRevocation(nameOrKey)
	if err != nil {
		return err
	}
	m.mu.Lock()
	rt := make(map[revocation]bool, len(m.trust.runtime)+1)
	for k := range m.trust.runtime {
		rt[k] = true
	}
	rt[r] = true
	m.trust = m.trust.withRuntime(rt)
	m.mu.Unlock()
	m.log.Info("revoked", zap.Stringer("node_or_key", r))
	m.enforceAdmission()
	return nil
}

// Unrevoke lifts a run-time revocation. A revocation listed in the trust
// configuration returns ErrRevokedByConfig.
func (m *Mesh) Unrevoke(nameOrKey string) error {
	r, err := parseRevocation(nameOrKey)
	if err != nil {
		return err
	}
	m.mu.Lock()
	if m.trust.config[r] {
		m.mu.Unlock()
		return fmt.Errorf("unrevoke %s: %w", r, ErrRevokedByConfig)
	}
	rt := make(map[revocation]bool, len(m.trust.runtime))
	for k := range m.trust.runtime {
		if k != r {
			rt[k] = true
		}
	}
	m.trust = m.trust.withRuntime(rt)
	m.mu.Unlock()
	m.log.Info("unrevoked", zap.Stringer("node_or_key", r))
	m.enforceAdmission()
	m.contactRefused()
	return nil
}

// Revoked lists the run-time revocations (names and base64 keys), sorted.
func (m *Mesh) Revoked() []string {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([]string, 0, len(m.trust.runtime))
	for r := range m.trust.runtime {
		out = append(out, r.String())
	}
	slices.Sort(out)
	return out
}

// enforceAdmission removes from placement, and forgets the adverts of,
// every peer that is no longer admitted (revoked, expired, trust changed).
// A peer admitted again is heard from its next advert on.
func (m *Mesh) enforceAdmission() {
	now := m.cfg.Now()
	m.advMu.Lock()
	defer m.advMu.Unlock()
	var drop, readmitted []string
	m.mu.Lock()
	for name, p := range m.peers {
		s, why := m.trust.admit(name, p.meta.key, p.meta.cert, p.certOK, now)
		switch {
		case s == 0 && !m.removed[name]:
			m.removed[name] = true
			drop = append(drop, name)
			m.log.Info("peer no longer admitted", zap.String("peer", name), zap.String("why", why))
		case s != 0 && m.removed[name]:
			delete(m.removed, name)
			readmitted = append(readmitted, p.addr)
			m.log.Info("peer admitted again", zap.String("peer", name))
		}
	}
	m.mu.Unlock()
	if len(readmitted) > 0 {
		// Hear its adverts now, not at its next refresh: one push/pull
		// brings its current ones (their sequence numbers are the ones we
		// forgot at the revocation, which handleAdvert accepts again).
		m.spawn(func() {
			if _, err := m.ml.Join(readmitted); err != nil {
				m.log.Debug("push/pull with peers admitted again", zap.Error(err))
			}
		})
	}
	for _, name := range drop {
		m.forgetOriginLocked(name)
		if m.sink != nil {
			m.sink.RemoveNode(name)
		}
	}
}

// AdmissionProxy lets a placement table be built before the Mesh that
// admits for it (the Mesh needs the table as its Sink): give the table the
// proxy, then Bind the Mesh, or name the proxy in Config.Admission. Until
// bound, nothing is admitted.
type AdmissionProxy struct{ m atomic.Pointer[Mesh] }

var _ placement.Admission = (*AdmissionProxy)(nil)

// Bind makes the proxy answer for m (nil: for none).
func (a *AdmissionProxy) Bind(m *Mesh) { a.m.Store(m) }

// IsAdmitted forwards to the bound Mesh; false while unbound.
func (a *AdmissionProxy) IsAdmitted(node string) bool {
	m := a.m.Load()
	return m != nil && m.IsAdmitted(node)
}

// Trusted forwards to the bound Mesh; false while unbound.
func (a *AdmissionProxy) Trusted(node string) bool {
	m := a.m.Load()
	return m != nil && m.Trusted(node)
}

// MayServe forwards to the bound Mesh; false while unbound.
func (a *AdmissionProxy) MayServe(node string) bool {
	m := a.m.Load()
	return m != nil && m.MayServe(node)
}
