// Package placement is the placement table: which node serves infer.<role>
// right now, and who may use or serve what.
//
// Local instances are registered by the agent (RegisterLocal); remote ones
// come from infer.<role> advertisements of admitted peers
// (IngestAdvertisement). Resolve prefers the local instance (sticky: warm
// caches), then admitted, allowlisted, fresh peers, least loaded first.
// Every real change bumps a generation and closes the Changed channel so
// caches can be invalidated.
//
// Policy is default deny on both sides: a remote node serves a role to us
// only once AllowRemoteNode allowlisted it, and we serve a role to a peer
// only once the role is exposed (ExposeToMesh) and the peer is on its serve
// list (AllowMeshPeer). Policy changes and refusals are audited.
//
// The package is pure data and policy: no I/O, no goroutines. Every method
// of Table is safe for concurrent use.
package placement

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"
)

type remoteEntry struct {
	ad Advert
	// received is when *we* received the latest copy. The peer's own clock
	// is never trusted for freshness.
	received time.Time
	// loadSeq changes whenever the load and capacity held change (an
	// advert saying something new, a load report): Candidate.LoadSeq.
	loadSeq uint64
}

// Table maps roles to the nodes serving them. Create it with New.
type Table struct {
	nodeID    string
	admission Admission
	audit     AuditSink
	ttl       time.Duration
	now       func() time.Time

	mu         sync.RWMutex
	local      map[string]Local
	localLoad  map[string]uint32
	localCap   map[string]Capacity
	remote     map[string]map[string]remoteEntry // role -> node -> entry
	allow      map[string]map[string]struct{}    // consumer side: role -> nodes
	serve      map[string]map[string]struct{}    // serving side: role -> peers
	exposed    map[string]struct{}
	proxyPorts map[string]uint16
	gen        uint64
	loadSeq    uint64 // the last remoteEntry.loadSeq given
	changed    chan struct{}
}

// New returns an empty table for cfg.NodeID.
func New(cfg Config) (*Table, error) {
	if cfg.NodeID == "" {
		return nil, fmt.Errorf("placement: Config.NodeID is required")
	}
	if cfg.AdvertTTL < 0 {
		return nil, fmt.Errorf("placement: Config.AdvertTTL must not be negative, got %v", cfg.AdvertTTL)
	}
	d := DefaultConfig()
	if cfg.AdvertTTL == 0 {
		cfg.AdvertTTL = d.AdvertTTL
	}
	if cfg.Now == nil {
		cfg.Now = d.Now
	}
	return &Table{
		nodeID:     cfg.NodeID,
		admission:  cfg.Admission,
		audit:      cfg.Audit,
		ttl:        cfg.AdvertTTL,
		now:        cfg.Now,
		local:      map[string]Local{},
		localLoad:  map[string]uint32{},
		localCap:   map[string]Capacity{},
		remote:     map[string]map[string]remoteEntry{},
		allow:      map[string]map[string]struct{}{},
		serve:      map[string]map[string]struct{}{},
		exposed:    map[string]struct{}{},
		proxyPorts: map[string]uint16{},
		changed:    make(chan struct{}),
	}, nil
}

// NodeID is this node's id.
func (t *Table) NodeID() string { return t.nodeID }

// AdvertTTL is the lifetime of a received advertisement.
func (t *Table) AdvertTTL() time.Duration { return t.ttl }

// Generation counts real changes so far. A cache keyed on it is never stale,
// except for advertisements expiring by time alone: see ExpireStale.
func (t *Table) Generation() uint64 {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.gen
}

// Changed returns a channel that is closed at the next generation bump.
// Call it again after it fires to wait for the following one.
func (t *Table) Changed() <-chan struct{} {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.changed
}

// bumpLocked records a real change. t.mu must be held for writing.
func (t *Table) bumpLocked() {
	t.gen++
	close(t.changed)
	t.changed = make(chan struct{})
}

func (t *Table) emit(events []AuditEvent) {
	if t.audit == nil {
		return
	}
	for _, e := range events {
		t.audit.Audit(e)
	}
}

func (t *Table) policyRefused(op, role, node string, why Reason) {
	t.emit([]AuditEvent{{
		Kind: AuditPolicyRefused, Role: role, Node: node,
		Fields: map[string]string{"op": op, "why": string(why), "node_id": t.nodeID},
	}})
}

// RegisterLocal serves role from the local instance l. The role must be
// valid and l.Base a loopback base URL (see ParseLoopbackBase); it is stored
// in canonical form. The generation is bumped only when something changed.
func (t *Table) RegisterLocal(role string, l Local) error {
	if err := ValidateRole(role); err != nil {
		return fmt.Errorf("register local: %w", err)
	}
	base, err := ParseLoopbackBase(l.Base)
	if err != nil {
		return fmt.Errorf("register local %q: %w", role, err)
	}
	l.Base = base
	t.mu.Lock()
	defer t.mu.Unlock()
	if prev, ok := t.local[role]; !ok || prev != l {
		t.local[role] = l
		t.bumpLocked()
	}
	return nil
}

// DeregisterLocal stops serving role locally. Its local load is forgotten too.
func (t *Table) DeregisterLocal(role string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.localLoad, role)
	delete(t.localCap, role)
	if _, ok := t.local[role]; ok {
		delete(t.local, role)
		t.bumpLocked()
	}
}

// SetLocalLoad sets the load carried in our advertisements of role. It does
// not bump the generation: it changes nothing this node resolves.
func (t *Table) SetLocalLoad(role string, load uint32) {
	if ValidateRole(role) != nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.localLoad[role] = load
}

// SetLocalCapacity sets the capacity carried in our advertisements of
// role (what its instance reports). Like SetLocalLoad it does not bump the
// generation.
func (t *Table) SetLocalCapacity(role string, c Capacity) {
	if ValidateRole(role) != nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.localCap[role] = c
}

// setMember adds or removes node from m[role]; it reports a real change.
func setMember(m map[string]map[string]struct{}, role, node string, on bool) bool {
	set := m[role]
	_, had := set[node]
	if had == on {
		return false
	}
	if on {
		if set == nil {
			set = map[string]struct{}{}
			m[role] = set
		}
		set[node] = struct{}{}
	} else {
		delete(set, node)
		if len(set) == 0 {
			delete(m, role)
		}
	}
	return true
}

func has(m map[string]map[string]struct{}, role, node string) bool {
	_, ok := m[role][node]
	return ok
}

// AllowRemoteNode allows (on) or stops allowing node to serve role to this
// node: the consumer-side decision to send this node's prompts to that node.
// Without it no advertisement of node for role is heard or resolved. A real
// change is audited (AuditRemoteAllow) and bumps the generation; revoking
// takes effect on the next Resolve.
func (t *Table) AllowRemoteNode(role, node string, on bool) {
	t.setAllowlist("allow_remote_node", t.allow, AuditRemoteAllow, "consumer", role, node, on)
}

// AllowMeshPeer allows (on) or stops allowing peer to use this node's local
// instance of role: the serving-side counterpart of AllowRemoteNode.
// Exposure (ExposeToMesh) says the role may leave loopback at all; this says
// to whom. A real change is audited (AuditMeshAllow) and bumps the generation.
func (t *Table) AllowMeshPeer(role, peer string, on bool) {
	t.setAllowlist("allow_mesh_peer", t.serve, AuditMeshAllow, "server", role, peer, on)
}

// setAllowlist puts node on (or takes it off) one of the two allowlists,
// list (role -> node set, guarded by t.mu). A real change bumps the
// generation and is audited as kind, with this node named as side (the
// consumer or the server).
func (t *Table) setAllowlist(op string, list map[string]map[string]struct{}, kind, side, role, node string, on bool) {
	if !t.policyArgsOK(op, role, node) {
		return
	}
	t.mu.Lock()
	changed := setMember(list, role, node, on)
	if changed {
		t.bumpLocked()
	}
	t.mu.Unlock()
	if changed {
		t.emit([]AuditEvent{{
			Kind: kind, Role: role, Node: node,
			Fields: map[string]string{"allowed": strconv.FormatBool(on), side: t.nodeID},
		}})
	}
}

func (t *Table) policyArgsOK(op, role, node string) bool {
	if ValidateRole(role) != nil {
		t.policyRefused(op, role, node, ReasonBadRole)
		return false
	}
	if node == "" {
		t.policyRefused(op, role, node, ReasonEmptyNode)
		return false
	}
	return true
}

// ExposeToMesh allows (on) or stops allowing role to be served to mesh
// peers at all. A real change is audited (AuditMeshExpose) and bumps the
// generation.
func (t *Table) ExposeToMesh(role string, on bool) {
	if ValidateRole(role) != nil {
		t.policyRefused("expose_to_mesh", role, "", ReasonBadRole)
		return
	}
	t.mu.Lock()
	_, had := t.exposed[role]
	changed := had != on
	if changed {
		if on {
			t.exposed[role] = struct{}{}
		} else {
			delete(t.exposed, role)
		}
		t.bumpLocked()
	}
	t.mu.Unlock()
	if changed {
		t.emit([]AuditEvent{{
			Kind: AuditMeshExpose, Role: role,
			Fields: map[string]string{"exposed": strconv.FormatBool(on), "node_id": t.nodeID},
		}})
	}
}

// MeshPeerAllowed reports whether peer is on role's serve list.
func (t *Table) MeshPeerAllowed(role, peer string) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return has(t.serve, role, peer)
}

// RemoteNodeAllowed reports whether node is allowlisted to serve role to us.
func (t *Table) RemoteNodeAllowed(role, node string) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return has(t.allow, role, node)
}

// ExposedRoles returns the roles exposed to the mesh, sorted.
func (t *Table) ExposedRoles() []string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return slices.Sorted(maps.Keys(t.exposed))
}

// PeerListedAny reports whether peer is on any role's serve list (e.g. to
// decide whether to accept its connection at all).
func (t *Table) PeerListedAny(peer string) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, set := range t.serve {
		if _, ok := set[peer]; ok {
			return true
		}
	}
	return false
}

// SetProxyPort records the loopback proxy port that fronts role on this
// node; 0 forgets it. A real change bumps the generation (BaseURLForRole
// depends on it).
func (t *Table) SetProxyPort(role string, port uint16) {
	t.mu.Lock()
	defer t.mu.Unlock()
	prev, ok := t.proxyPorts[role]
	switch {
	case port == 0 && ok:
		delete(t.proxyPorts, role)
	case port != 0 && (!ok || prev != port):
		t.proxyPorts[role] = port
	default:
		return
	}
	t.bumpLocked()
}

// ProxyPort returns the loopback proxy port registered for role.
func (t *Table) ProxyPort(role string) (uint16, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	p, ok := t.proxyPorts[role]
	return p, ok
}

// CheckPeer returns the local instance of role that peer's forwarded
// request may reach, or a *RefusedError saying why not. peer must be the
// node id the connection was verified as. It requires, in this order: a
// valid role; peer is not this node; peer still trusted (Admission.Trusted,
// when the table has an Admission: re-checked on every call so revocation
// takes effect at once; a live membership is not asked, the connection
// proved the peer); role exposed; peer on the role's serve list; a local
// instance.
// It never returns a remote target, so a request cannot be bounced from node
// to node. Refusals are audited (AuditPeerRefused).
func (t *Table) CheckPeer(role, peer string) (Local, error) {
	l, why := t.checkPeer(role, peer)
	if why == "" {
		return l, nil
	}
	t.emit([]AuditEvent{{
		Kind: AuditPeerRefused, Role: role, Node: peer,
		Fields: map[string]string{"why": string(why), "server": t.nodeID},
	}})
	return Local{}, &RefusedError{Reason: why, Role: role, Node: peer}
}

func (t *Table) checkPeer(role, peer string) (Local, Reason) {
	switch {
	case ValidateRole(role) != nil:
		return Local{}, ReasonBadRole
	case peer == "":
		return Local{}, ReasonEmptyNode
	case peer == t.nodeID:
		return Local{}, ReasonSelfNotPeer
	case t.admission != nil && !t.admission.Trusted(peer):
		return Local{}, ReasonNotAdmitted
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if _, ok := t.exposed[role]; !ok {
		return Local{}, ReasonNotExposed
	}
	if !has(t.serve, role, peer) {
		return Local{}, ReasonNotOnServeList
	}
	l, ok := t.local[role]
	if !ok {
		return Local{}, ReasonNoLocal
	}
	return l, ""
}

// LocalForPeer is CheckPeer without the reason: the local instance of role
// when it is exposed, peer is on its serve list (and still admitted), and a
// local instance exists. Never a remote target.
func (t *Table) LocalForPeer(role, peer string) (Local, bool) {
	l, err := t.CheckPeer(role, peer)
	return l, err == nil
}

// BaseURLForRole is the base URL (".../v1") an in-process consumer should
// use for role: the local instance itself when the first candidate is local,
// this node's loopback proxy when it is remote (the proxy speaks the mesh).
// False when nothing serves role, or it is remote and no proxy port is set.
func (t *Table) BaseURLForRole(role string) (string, bool) {
	c := t.Resolve(role)
	if len(c) == 0 {
		return "", false
	}
	if c[0].Kind == KindLocal {
		return c[0].Base + "/v1", true
	}
	port, ok := t.ProxyPort(role)
	if !ok {
		return "", false
	}
	return LoopbackProxyBase(port), true
}

// LocalBaseForRole is the base URL (".../v1") of the local instance of role,
// for consumers that cannot go through the mesh.
func (t *Table) LocalBaseForRole(role string) (string, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	l, ok := t.local[role]
	if !ok {
		return "", false
	}
	return l.Base + "/v1", true
}

// Advertisement is the infer.<role> advertisement of a locally served role
// that is exposed to the mesh.
func (t *Table) Advertisement(role string) (Advert, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.advertLocked(role)
}

func (t *Table) advertLocked(role string) (Advert, bool) {
	l, ok := t.local[role]
	if !ok {
		return Advert{}, false
	}
	if _, ok := t.exposed[role]; !ok {
		return Advert{}, false
	}
	return Advert{
		Name:     ServicePrefix + role,
		Node:     t.nodeID,
		API:      l.API,
		Runtime:  l.Runtime,
		Model:    l.Model,
		Load:     t.localLoad[role],
		Methods:  AdvertMethods(),
		Capacity: t.localCap[role],
	}, true
}

// Advertisements returns the advertisements of every exposed local role,
// sorted by name.
func (t *Table) Advertisements() []Advert {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var out []Advert
	for _, role := range slices.Sorted(maps.Keys(t.local)) {
		if ad, ok := t.advertLocked(role); ok {
			out = append(out, ad)
		}
	}
	return out
}
