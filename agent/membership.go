package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/store"
)

// This file connects the agent to its mesh membership (package mesh): the
// config's trust section in the mesh's form, and starting, joining, leaving
// and closing the membership.

// MeshTrust converts the trust section into the mesh's form, naming the
// field of any key that does not parse.
func (c *Config) MeshTrust() (mesh.TrustConfig, error) {
	var t mesh.TrustConfig
	if a := strings.TrimSpace(c.Trust.Authority); a != "" {
		k, err := identity.ParseAuthorityKey(a)
		if err != nil {
			return t, fieldErr("trust.authority", "%v", err)
		}
		t.Authorities = append(t.Authorities, k)
	}
	for i, n := range c.Trust.Nodes {
		k, err := identity.ParseNodeKey(n.PublicKey)
		if err != nil {
			return t, fieldErr(fmt.Sprintf("trust.nodes[%d].public_key", i), "%v", err)
		}
		scope := identity.ScopeFull
		if n.Scope != "" {
			if scope, err = identity.ParseScope(n.Scope); err != nil {
				return t, fieldErr(fmt.Sprintf("trust.nodes[%d].scope", i), "%v", err)
			}
		}
		t.Nodes = append(t.Nodes, mesh.TrustedNode{Name: n.Name, PublicKey: k, Scope: scope})
	}
	t.Revoked = append(t.Revoked, c.Trust.Revoked...)
	return t, nil
}

// startMesh creates the node's mesh membership and starts joining in the
// background. It returns nil, nil when no mesh is configured.
func (a *Agent) startMesh(ctx context.Context) (*mesh.Mesh, error) {
	mc := a.config().Mesh
	if !mc.Enabled() {
		return nil, nil
	}
	a.warnUnknownPolicyNodes()
	trust, err := a.config().MeshTrust()
	if err != nil {
		return nil, err
	}
	cert, err := a.config().ownCertificate() // checked at the start of Run
	if err != nil {
		return nil, err
	}
	quicAdv := mc.QUICAdvertise
	if quicAdv == "" {
		quicAdv = mc.QUIC
	}
	cfg := mesh.DefaultConfig()
	cfg.NodeName = a.config().Node.Name
	cfg.StateDir = a.config().Node.StateDir
	cfg.Cluster = mc.Cluster
	cfg.BindAddr = mc.Bind
	cfg.AdvertiseAddr = mc.Advertise
	cfg.QUICAddr = quicAdv
	cfg.Join = mc.Join
	cfg.KeyringPath = mc.GossipKeyring
	if cert != nil {
		cfg.Certificate = cert.String()
	}
	cfg.Trust = trust
	cfg.AdvertTTL = mc.AdvertTTL
	cfg.Sink = a.table
	cfg.Admission = &a.admission
	cfg.Audit = a.audit
	cfg.Logger = a.log.Named("mesh")
	if a.opts.MeshTuning != nil {
		a.opts.MeshTuning(&cfg)
	}
	m, err := mesh.New(cfg)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// readyJoinWait bounds how long readiness waits for the first round of
// join contacts (an unreachable peer's costs up to memberlist's TCP timeout).
const readyJoinWait = 5 * time.Second

// joinWatch is closed once the node has joined (a contact succeeded) or
// has nobody to join.
type joinWatch struct {
	once sync.Once
	done chan struct{}
}

func newJoinWatch() *joinWatch { return &joinWatch{done: make(chan struct{})} }

func (j *joinWatch) close() { j.once.Do(func() { close(j.done) }) }

// awaitFirstJoin waits until the node joined the mesh or has nobody to
// join (first is closed), readyJoinWait has passed or ctx ends. A node
// reports READY after it: a restarted agent then already knows its peers
// and what they serve, instead of answering its first requests with no
// instance. A node whose peers are all unreachable is ready after the
// bound and keeps trying.
func (a *Agent) awaitFirstJoin(ctx context.Context, first <-chan struct{}) {
	t := time.NewTimer(readyJoinWait)
	defer t.Stop()
	select {
	case <-first:
	case <-t.C:
		a.log.Warn("still joining the mesh; reporting ready", zap.Duration("waited", readyJoinWait))
	case <-ctx.Done():
	}
}

// healMesh joins the mesh and keeps it whole until ctx ends: it contacts
// the configured join addresses and the peers last seen (kept in the state
// store, st) whenever they are not live members, with backoff
// (mesh.Mesh.Heal). A permanent refusal is logged loudly and audited; the
// node keeps serving its local roles and keeps trying.
func (a *Agent) healMesh(ctx context.Context, m *mesh.Mesh, st *store.Store, jw *joinWatch) {
	var o mesh.HealOptions
	o.OnFirstRound = func(targets int, joined bool) {
		if targets == 0 || joined {
			jw.close() // nobody to join, or joined
		}
	}
	if st != nil {
		peers, err := newPeerBook(st)
		if err != nil {
			a.log.Error("mesh peers are not kept across restarts", zap.Error(err))
		} else {
			o.Peers = peers
		}
		seqs, err := newSeqBook(st)
		if err != nil {
			a.log.Error("advert sequence numbers are not kept across restarts", zap.Error(err))
		} else {
			o.Seqs = seqs
		}
	}
	var joined atomic.Bool
	o.OnJoin = func(addr string, members int) {
		jw.close()
		if !joined.Swap(true) {
			a.audit.Record(Event{Kind: "mesh.joined", Fields: map[string]string{"addr": addr, "members": fmt.Sprint(members)}})
		}
	}
	o.OnRefused = func(addr string, err error) {
		a.audit.Record(Event{Kind: "mesh.join.refused", Fields: map[string]string{"addr": addr, "why": err.Error()}})
	}
	if err := m.Heal(ctx, o); err != nil && !errors.Is(err, mesh.ErrClosed) {
		a.log.Error("mesh healing stopped", zap.Error(err))
	}
}

// leaveMesh tells peers we are going (they forget our adverts at once),
// bounded by a timeout.
func (a *Agent) leaveMesh(m *mesh.Mesh) {
	if err := m.Leave(leaveTimeout); err != nil {
		a.log.Warn("leaving the mesh", zap.Error(err))
	}
}

// leaveTimeout bounds the wait for our leave message to spread.
const leaveTimeout = 2 * time.Second

// closeMesh shuts the membership down (after leaveMesh on a clean stop;
// alone when start-up failed, and peers then declare us dead).
func (a *Agent) closeMesh(m *mesh.Mesh) {
	if err := m.Close(); err != nil {
		a.log.Warn("closing the mesh", zap.Error(err))
	}
}

// The mesh's buckets in the state store (store.MeshPeers, store.MeshSeqs),
// each one JSON value under one key (small, bounded by the mesh, written
// whole): the peers the mesh rejoins after a restart, and its advert
// sequence numbers (its own floor, and the high-water marks and advert sets
// of every origin heard).
const (
	keyMeshPeers = "known"
	keyMeshSeqs  = "state"
)

// peerBook is the mesh's list of last-known peers in the state store.
type peerBook struct {
	b *store.Bucket[[]mesh.KnownPeer]
}

var _ mesh.PeerBook = peerBook{}

func newPeerBook(st *store.Store) (peerBook, error) {
	b, err := store.OpenBucket[[]mesh.KnownPeer](st, store.MeshPeers)
	return peerBook{b}, err
}

// LoadPeers returns the saved peers; none when nothing was saved.
func (b peerBook) LoadPeers() ([]mesh.KnownPeer, error) {
	out, _, err := b.b.Get(keyMeshPeers)
	if err != nil {
		return nil, fmt.Errorf("load mesh peers: %w", err)
	}
	return out, nil
}

// SavePeers replaces the saved peers.
func (b peerBook) SavePeers(peers []mesh.KnownPeer) error {
	if err := b.b.Put(keyMeshPeers, peers); err != nil {
		return fmt.Errorf("save mesh peers: %w", err)
	}
	return nil
}

// seqBook is the mesh's advert sequence state in the state store.
type seqBook struct{ b *store.Bucket[mesh.SeqState] }

var _ mesh.SeqBook = seqBook{}

func newSeqBook(st *store.Store) (seqBook, error) {
	b, err := store.OpenBucket[mesh.SeqState](st, store.MeshSeqs)
	return seqBook{b}, err
}

// LoadSeqs returns the saved state; the zero state when nothing was saved.
func (b seqBook) LoadSeqs() (mesh.SeqState, error) {
	st, _, err := b.b.Get(keyMeshSeqs)
	if err != nil {
		return mesh.SeqState{}, fmt.Errorf("load advert sequence numbers: %w", err)
	}
	return st, nil
}

// SaveSeqs replaces the saved state.
func (b seqBook) SaveSeqs(st mesh.SeqState) error {
	if err := b.b.Put(keyMeshSeqs, st); err != nil {
		return fmt.Errorf("save advert sequence numbers: %w", err)
	}
	return nil
}

// UnknownPolicyNodes lists, as warnings, the nodes that roles.<r>.accept_from
// and serve_to name but trust.nodes does not, when no trust.authority is
// configured: then nothing can ever admit such a node, so the name is
// almost always a typo. With an authority any name may hold a certificate,
// and nothing is reported.
func (c *Config) UnknownPolicyNodes() []string {
	if strings.TrimSpace(c.Trust.Authority) != "" {
		return nil
	}
	trusted := map[string]bool{c.Node.Name: true}
	for _, n := range c.Trust.Nodes {
		trusted[n.Name] = true
	}
	roles := make([]string, 0, len(c.Roles))
	for r := range c.Roles {
		roles = append(roles, r)
	}
	slices.Sort(roles)
	var out []string
	for _, r := range roles {
		rc := c.Roles[r]
		for _, f := range []struct {
			key   string
			names []string
		}{{"accept_from", rc.AcceptFrom}, {"serve_to", rc.ServeTo}} {
			for _, n := range f.names {
				if !trusted[n] {
					out = append(out, fmt.Sprintf("roles.%s.%s names %q, which is not in trust.nodes (and no trust.authority is configured): it can never be admitted; a typo?", r, f.key, n))
				}
			}
		}
	}
	return out
}

// warnUnknownPolicyNodes logs UnknownPolicyNodes.
func (a *Agent) warnUnknownPolicyNodes() {
	for _, w := range a.config().UnknownPolicyNodes() {
		a.log.Warn(w)
	}
}
