package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/agent/store"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/proxy"
)

// MeshAPI is what the admin backend needs of the mesh. *mesh.Mesh
// satisfies it. Methods must be safe for concurrent use; the keyring
// changes may block while the change spreads (a few seconds at most).
type MeshAPI interface {
	Members() []mesh.PeerInfo
	GossipAddr() string
	ListKeys() (keys []mesh.KeyStatus, members int)
	InstallKey(key string) error
	UseKey(key string) error
	RemoveKey(key string) error
	Revoke(nameOrKey string) error
	Unrevoke(nameOrKey string) error
	Revoked() []string
	Refusals() map[string]uint64
}

// InstanceAPI is what the admin backend needs of provisioning.
// *provision.Manager satisfies it. Methods must be safe for concurrent use
// and must not block.
type InstanceAPI interface {
	Instances() []provision.InstanceStatus
	Instance(role string) (provision.InstanceStatus, bool)
	Logs(role string, n int) []provision.LogLine
	// Retry starts a given-up instance again (provision.ErrNoInstance,
	// provision.ErrNotFailed).
	Retry(role string) error
}

var (
	_ MeshAPI       = (*mesh.Mesh)(nil)
	_ InstanceAPI   = (*provision.Manager)(nil)
	_ admin.Backend = (*Backend)(nil)
)

// Audit kinds of the admin socket.
const (
	AuditAdminPolicy  = "admin.policy"
	AuditAdminReset   = "admin.policy.reset"
	AuditAdminKeyring = "admin.keyring"
	AuditAdminReload  = "admin.reload"
	AuditAdminRefused = "admin.refused"
	AuditAdminRetry   = "admin.instance.retry"
)

// AdminOptions are the parts of the agent the admin backend reaches that
// the Agent may not have: nil means "not configured" and the API says so.
type AdminOptions struct {
	// Mesh: peers, keyring, revocation. Nil: no mesh on this node.
	Mesh MeshAPI
	// Instances: managed instances and their logs. Nil: no provisioning.
	Instances InstanceAPI
	// Metrics are served at /metrics on the socket and on admin.metrics.
	// Nil: no metrics.
	Metrics *metrics.Metrics
	// OnReload is called by Reload after the new config's role policy is
	// applied, to apply what else can change at run time (e.g. trust with
	// mesh.SetTrust). It may move entries of res.NeedsRestart it applied
	// to res.Applied. An error fails the reload (role policy stays
	// applied). Nil: every non-policy change needs a restart.
	OnReload func(old, new *Config, res *admin.ReloadResult) error
	// StoreLockTimeout bounds the wait for the state store's lock.
	// Default 1s.
	StoreLockTimeout time.Duration
}

// Backend is the agent's implementation of admin.Backend: it reads the
// placement table, the mesh and provisioning, and owns run-time policy
// (config baseline + stored overrides, see package store). Safe for
// concurrent use.
type Backend struct {
	a        *Agent
	store    *store.Store
	mesh     MeshAPI
	inst     InstanceAPI
	onReload func(old, new *Config, res *admin.ReloadResult) error
	log      *zap.Logger

	// mu serializes changes (store write + apply) and reloads.
	mu  sync.Mutex
	cfg atomic.Pointer[Config] // the baseline: the config last loaded
}

// NewBackend returns the backend of a over st, and applies the config's
// policy with the stored overrides on top.
func NewBackend(a *Agent, st *store.Store, opts AdminOptions) (*Backend, error) {
	if a == nil || st == nil {
		return nil, errors.New("admin backend: nil agent or store")
	}
	b := &Backend{a: a, store: st, mesh: opts.Mesh, inst: opts.Instances, onReload: opts.OnReload, log: a.log.Named("admin")}
	b.cfg.Store(a.cfg)
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.applyLocked(); err != nil {
		return nil, err
	}
	return b, nil
}

// ---- policy: config baseline + overrides ----

// fact is one effective policy fact and where it came from.
type fact struct {
	on     bool
	source string
	by     string
	at     time.Time
}

// effectivePolicy is the config with the overrides on top.
type effectivePolicy struct {
	expose   map[string]fact            // role ->
	serve    map[string]map[string]fact // role -> peer -> (on or off)
	accept   map[string]map[string]fact // role -> node -> (on or off)
	revoked  map[string]fact            // run-time revocations
	active   int                        // overrides in force
	inactive map[store.Key]bool         // overrides naming a role the config lacks
}

func computePolicy(cfg *Config, ovs []store.Override) effectivePolicy {
	p := effectivePolicy{
		expose: map[string]fact{}, serve: map[string]map[string]fact{}, accept: map[string]map[string]fact{},
		revoked: map[string]fact{}, inactive: map[store.Key]bool{},
	}
	set := func(m map[string]map[string]fact, role, node string, f fact) {
		if m[role] == nil {
			m[role] = map[string]fact{}
		}
		m[role][node] = f
	}
	for name, r := range cfg.Roles {
		if r.Expose {
			p.expose[name] = fact{on: true, source: admin.SourceConfig}
		} else {
			p.expose[name] = fact{on: false, source: admin.SourceDefault}
		}
		p.serve[name] = map[string]fact{}
		p.accept[name] = map[string]fact{}
		for _, n := range r.ServeTo {
			set(p.serve, name, n, fact{on: true, source: admin.SourceConfig})
		}
		for _, n := range r.AcceptFrom {
			set(p.accept, name, n, fact{on: true, source: admin.SourceConfig})
		}
	}
	for _, o := range ovs {
		f := fact{on: o.On, source: admin.SourceRuntime, by: o.By, at: o.At}
		if o.Kind == store.KindRevoke {
			p.revoked[o.Node] = f
			p.active++
			continue
		}
		if _, ok := cfg.Roles[o.Role]; !ok {
			p.inactive[o.Key()] = true
			continue
		}
		p.active++
		switch o.Kind {
		case store.KindExpose:
			p.expose[o.Role] = f
		case store.KindServeTo:
			set(p.serve, o.Role, o.Node, f)
		case store.KindAcceptFrom:
			set(p.accept, o.Role, o.Node, f)
		}
	}
	return p
}

func (p effectivePolicy) lookup(k store.Key) fact {
	switch k.Kind {
	case store.KindExpose:
		return p.expose[k.Role]
	case store.KindServeTo:
		return p.serve[k.Role][k.Node]
	case store.KindAcceptFrom:
		return p.accept[k.Role][k.Node]
	case store.KindRevoke:
		return p.revoked[k.Node]
	}
	return fact{}
}

func onSet(m map[string]fact) map[string]bool {
	out := map[string]bool{}
	for n, f := range m {
		if f.on {
			out[n] = true
		}
	}
	return out
}

// applyLocked makes the placement table (and the mesh's run-time
// revocations) match the baseline config with the stored overrides on top,
// whatever they held before. b.mu must be held.
func (b *Backend) applyLocked() (effectivePolicy, error) {
	ovs, err := b.store.Overrides()
	if err != nil {
		return effectivePolicy{}, err
	}
	p := computePolicy(b.cfg.Load(), ovs)
	t := b.a.table
	snap := t.Snapshot()

	exposed := map[string]bool{}
	for _, r := range snap.Exposed {
		exposed[r] = true
	}
	for _, role := range sortedKeys(unionKeys(exposed, p.expose)) {
		if want := p.expose[role].on; want != exposed[role] {
			t.ExposeToMesh(role, want)
		}
	}
	reconcile := func(have map[string][]string, want map[string]map[string]fact, apply func(role, node string, on bool)) {
		roles := map[string]bool{}
		for r := range have {
			roles[r] = true
		}
		for r := range want {
			roles[r] = true
		}
		for _, role := range sortedKeys(roles) {
			h := map[string]bool{}
			for _, n := range have[role] {
				h[n] = true
			}
			w := onSet(want[role])
			for _, n := range sortedKeys(unionKeys(h, w)) {
				if h[n] != w[n] {
					apply(role, n, w[n])
				}
			}
		}
	}
	reconcile(snap.Serve, p.serve, t.AllowMeshPeer)
	reconcile(snap.Allow, p.accept, t.AllowRemoteNode)

	if b.mesh != nil {
		var errs []error
		for _, r := range b.mesh.Revoked() {
			if _, ok := p.revoked[r]; !ok {
				if err := b.mesh.Unrevoke(r); err != nil && !errors.Is(err, mesh.ErrRevokedByConfig) {
					errs = append(errs, err)
				}
			}
		}
		for _, n := range sortedKeys(p.revoked) {
			if err := b.mesh.Revoke(n); err != nil {
				errs = append(errs, fmt.Errorf("revoke %s: %w", n, err))
			}
		}
		if err := errors.Join(errs...); err != nil {
			return p, fmt.Errorf("apply run-time revocations: %w", err)
		}
	}
	return p, nil
}

func (b *Backend) policy() (effectivePolicy, error) {
	ovs, err := b.store.Overrides()
	if err != nil {
		return effectivePolicy{}, err
	}
	return computePolicy(b.cfg.Load(), ovs), nil
}

// SetPolicy implements admin.Backend.
func (b *Backend) SetPolicy(_ context.Context, by admin.Caller, c admin.PolicyChange) (admin.PolicyResult, error) {
	cfg := b.cfg.Load()
	k := store.Key{Kind: store.Kind(c.Kind), Role: c.Role, Node: strings.TrimSpace(c.Node)}
	var note string
	switch k.Kind {
	case store.KindAcceptFrom, store.KindServeTo, store.KindExpose:
		if err := placement.ValidateRole(k.Role); err != nil {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%v", err)
		}
		if _, ok := cfg.Roles[k.Role]; !ok {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrNotFound, "role %q is not in the config of node %s", k.Role, cfg.Node.Name)
		}
		if k.Kind == store.KindExpose {
			if k.Node != "" {
				return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "expose takes a role, not a node")
			}
			break
		}
		if err := validNodeName(k.Node); err != nil {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "node: %v", err)
		}
		if k.Node == cfg.Node.Name {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%q is this node; policy is about other nodes", k.Node)
		}
	case store.KindRevoke:
		if k.Role != "" || k.Node == "" {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "revoke takes a node name or public key, and no role")
		}
		if k.Node == cfg.Node.Name {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%q is this node", k.Node)
		}
		if validNodeName(k.Node) != nil {
			if _, err := identity.ParsePublicKey(k.Node); err != nil {
				return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%q is neither a node name nor a public key", k.Node)
			}
		}
		if !c.On && slices.Contains(cfg.Trust.Revoked, k.Node) {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrConflict, "%q is revoked by the config file (trust.revoked); edit it and reload", k.Node)
		}
		if b.mesh == nil {
			note = "no mesh on this node: recorded, and applied once the mesh is configured"
		}
	default:
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "unknown policy kind %q (accept_from, serve_to, expose, revoke)", c.Kind)
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	before, err := b.policy()
	if err != nil {
		return admin.PolicyResult{}, err
	}
	o := store.Override{Kind: k.Kind, Role: k.Role, Node: k.Node, On: c.On, By: by.String()}
	if k.Kind == store.KindRevoke && !c.On {
		// Lifting a run-time revocation deletes it: there is nothing in
		// the config to override.
		_, had, err := b.store.Delete(k)
		if err != nil {
			return admin.PolicyResult{}, err
		}
		if !had && note == "" {
			note = fmt.Sprintf("%s was not revoked at run time", k.Node)
		}
		o.At = time.Now().UTC()
	} else {
		o.At = time.Now().UTC()
		if _, _, err := b.store.Put(o); err != nil {
			return admin.PolicyResult{}, err
		}
	}
	after, err := b.applyLocked()
	if err != nil {
		return admin.PolicyResult{}, err
	}
	if k.Kind == store.KindServeTo && c.On && !after.expose[k.Role].on {
		note = fmt.Sprintf("role %s is not exposed: peers are refused until `infermesh expose %s`", k.Role, k.Role)
	}
	if k.Kind == store.KindExpose && c.On && len(onSet(after.serve[k.Role])) == 0 {
		note = fmt.Sprintf("no peer is on the serve list of %s yet (`infermesh serve-to add %s NODE`)", k.Role, k.Role)
	}
	changed := before.lookup(k).on != after.lookup(k).on
	b.a.audit.Record(Event{Kind: AuditAdminPolicy, Role: k.Role, Node: k.Node, Fields: map[string]string{
		"policy": string(k.Kind), "on": fmt.Sprint(c.On), "by": o.By, "changed": fmt.Sprint(changed),
	}})
	return admin.PolicyResult{Override: toAdminOverride(o, true), Changed: changed, Note: note}, nil
}

// Policy implements admin.Backend.
func (b *Backend) Policy(context.Context) ([]admin.Override, error) {
	ovs, err := b.store.Overrides()
	if err != nil {
		return nil, err
	}
	p := computePolicy(b.cfg.Load(), ovs)
	out := make([]admin.Override, 0, len(ovs))
	for _, o := range ovs {
		out = append(out, toAdminOverride(o, !p.inactive[o.Key()]))
	}
	return out, nil
}

// ResetPolicy implements admin.Backend.
func (b *Backend) ResetPolicy(_ context.Context, by admin.Caller, f admin.PolicyFilter) (admin.ResetResult, error) {
	if f.Kind != "" && !store.Kind(f.Kind).Valid() {
		return admin.ResetResult{}, admin.Errorf(admin.ErrInvalid, "unknown policy kind %q", f.Kind)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	gone, err := b.store.Reset(store.Filter{Kind: store.Kind(f.Kind), Role: f.Role, Node: f.Node})
	if err != nil {
		return admin.ResetResult{}, err
	}
	if _, err := b.applyLocked(); err != nil {
		return admin.ResetResult{}, err
	}
	res := admin.ResetResult{Removed: make([]admin.Override, 0, len(gone))}
	for _, o := range gone {
		res.Removed = append(res.Removed, toAdminOverride(o, false))
	}
	b.a.audit.Record(Event{Kind: AuditAdminReset, Role: f.Role, Node: f.Node, Fields: map[string]string{
		"policy": f.Kind, "removed": fmt.Sprint(len(gone)), "by": by.String(),
	}})
	return res, nil
}

func toAdminOverride(o store.Override, active bool) admin.Override {
	return admin.Override{Kind: string(o.Kind), Role: o.Role, Node: o.Node, On: o.On, At: o.At, By: o.By, Active: active}
}

// ---- reads ----

// Status implements admin.Backend.
func (b *Backend) Status(context.Context) (admin.Status, error) {
	cfg := b.cfg.Load()
	p, err := b.policy()
	if err != nil {
		return admin.Status{}, err
	}
	snap := b.a.table.Snapshot()
	now := time.Now()
	st := admin.Status{
		Node:          cfg.Node.Name,
		Version:       Version,
		Started:       b.a.started.UTC(),
		UptimeSeconds: now.Sub(b.a.started).Seconds(),
		Config:        cfg.Path(),
		Generation:    snap.Generation,
		Mesh:          admin.MeshStatus{State: "disabled"},
		LocalRoles:    sortedKeys(snap.Locals),
		RemoteRoles:   []admin.RemoteRole{},
		Overrides:     p.active,
	}
	if b.mesh != nil {
		members := b.mesh.Members()
		st.Mesh = admin.MeshStatus{State: "alone", GossipAddr: b.mesh.GossipAddr(), Members: len(members)}
		for _, m := range members {
			if m.Admitted {
				st.Mesh.Admitted++
			}
		}
		if len(members) > 1 {
			st.Mesh.State = "joined"
		}
	}
	roles := map[string]bool{}
	for _, r := range snap.Remotes {
		roles[r.Role] = true
	}
	for _, role := range sortedKeys(roles) {
		var nodes []string
		for _, c := range b.a.table.Resolve(role) {
			if c.Kind == placement.KindRemote {
				nodes = append(nodes, c.Node)
			}
		}
		if len(nodes) > 0 {
			st.RemoteRoles = append(st.RemoteRoles, admin.RemoteRole{Role: role, Nodes: nodes})
		}
	}
	return st, nil
}

// Peers implements admin.Backend. Without a mesh it lists this node only.
func (b *Backend) Peers(context.Context) ([]admin.Peer, error) {
	snap := b.a.table.Snapshot()
	byNode := map[string][]string{}
	for _, r := range snap.Remotes {
		byNode[r.Node] = append(byNode[r.Node], r.Role)
	}
	if b.mesh == nil {
		return []admin.Peer{{Name: snap.NodeID, State: admin.PeerSelf, Scope: "full", Roles: ownRoles(snap)}}, nil
	}
	var out []admin.Peer
	for _, m := range b.mesh.Members() {
		p := admin.Peer{
			Name: m.Name, GossipAddr: m.GossipAddr, QUICAddr: m.QUICAddr, Why: m.Why,
			Roles: append([]string{}, byNode[m.Name]...),
		}
		if len(m.PublicKey) > 0 {
			p.PublicKey = identity.EncodeKey(m.PublicKey)
		}
		if m.Scope != 0 {
			p.Scope = m.Scope.String()
		}
		switch {
		case m.Self:
			p.State = admin.PeerSelf
			p.Roles = ownRoles(snap)
		case m.Admitted:
			p.State = admin.PeerAdmitted
		default:
			p.State = admin.PeerNotAdmitted
		}
		out = append(out, p)
	}
	return out, nil
}

// ownRoles are the roles this node advertises (exposed and served locally).
func ownRoles(snap placement.Snapshot) []string {
	out := []string{}
	for _, r := range snap.Exposed {
		if _, ok := snap.Locals[r]; ok {
			out = append(out, r)
		}
	}
	return out
}

// Roles implements admin.Backend.
func (b *Backend) Roles(context.Context) ([]admin.Role, error) {
	cfg := b.cfg.Load()
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	snap := b.a.table.Snapshot()
	remotes := map[string][]admin.RemoteAd{}
	for _, r := range snap.Remotes {
		remotes[r.Role] = append(remotes[r.Role], admin.RemoteAd{
			Node: r.Node, Model: r.Advert.Model, Load: r.Advert.Load,
			AgeSeconds: r.Age.Round(100 * time.Millisecond).Seconds(), Fresh: r.Fresh,
		})
	}
	out := []admin.Role{}
	for _, name := range sortedKeys(cfg.Roles) {
		r := admin.Role{
			Name: name, Configured: true,
			Expose:     toRule("", p.expose[name]),
			ServeTo:    toRules(p.serve[name]),
			AcceptFrom: toRules(p.accept[name]),
			Remotes:    append([]admin.RemoteAd{}, remotes[name]...),
		}
		if addr, ok := b.a.RoleAddr(name); ok {
			r.Addr = addr.String()
		}
		if l, ok := snap.Locals[name]; ok {
			r.Local = &admin.LocalTarget{Base: l.Base, Model: l.Model, Runtime: l.Runtime}
		}
		out = append(out, r)
	}
	return out, nil
}

func toRule(node string, f fact) admin.Rule {
	r := admin.Rule{Node: node, On: f.on, Source: f.source, By: f.by}
	if r.Source == "" {
		r.Source = admin.SourceDefault
	}
	if !f.at.IsZero() {
		at := f.at.UTC()
		r.At = &at
	}
	return r
}

func toRules(m map[string]fact) []admin.Rule {
	out := []admin.Rule{}
	for _, n := range sortedKeys(m) {
		out = append(out, toRule(n, m[n]))
	}
	return out
}

// Route implements admin.Backend: placement's verdict on every node it
// knows for role, plus this node when it does not serve the role and mesh
// members placement has never heard of for it.
func (b *Backend) Route(_ context.Context, role string) (admin.Route, error) {
	if err := placement.ValidateRole(role); err != nil {
		return admin.Route{}, admin.Errorf(admin.ErrInvalid, "%v", err)
	}
	cfg := b.cfg.Load()
	t := b.a.table
	ds := t.Explain(role)
	_, configured := cfg.Roles[role]
	if !configured && len(ds) == 0 {
		return admin.Route{}, admin.Errorf(admin.ErrNotFound, "role %q is not in the config of node %s and no node advertises it", role, cfg.Node.Name)
	}
	rt := admin.Route{Role: role, Generation: t.Generation(), Decisions: []admin.Decision{}}
	seen := map[string]bool{}
	for _, d := range ds {
		seen[d.Node] = true
		ad := admin.Decision{
			Node: d.Node, Kind: d.Kind.String(), Candidate: d.Candidate, Rank: d.Rank,
			Model: d.Model, Load: d.Load, HasAdvert: d.HasAdvert,
		}
		if d.HasAdvert {
			ad.AgeSeconds = d.Age.Round(100 * time.Millisecond).Seconds()
		}
		for _, r := range d.Reasons {
			ad.Reasons = append(ad.Reasons, string(r))
		}
		rt.Decisions = append(rt.Decisions, ad)
	}
	b.proxyOrder(role, rt.Decisions)
	for _, d := range rt.Decisions {
		if d.Candidate && d.Rank == 0 {
			rt.Serving = d.Node
		}
	}
	if !seen[t.NodeID()] {
		why := []string{string(placement.ReasonNoLocal)}
		if b.inst != nil {
			if st, ok := b.inst.Instance(role); ok {
				why = append(why, "managed instance "+string(st.State))
			}
		}
		rt.Decisions = append(rt.Decisions, admin.Decision{Node: t.NodeID(), Kind: placement.KindLocal.String(), Rank: -1, Reasons: why})
	}
	if b.mesh != nil {
		for _, m := range b.mesh.Members() {
			if m.Self || seen[m.Name] {
				continue
			}
			d := admin.Decision{Node: m.Name, Kind: placement.KindRemote.String(), Rank: -1}
			if !t.RemoteNodeAllowed(role, m.Name) {
				d.Reasons = append(d.Reasons, string(placement.ReasonNotAllowlisted))
			}
			d.Reasons = append(d.Reasons, string(placement.ReasonNoAdvert))
			if !m.Admitted {
				d.Reasons = append(d.Reasons, string(placement.ReasonNotAdmitted)+": "+m.Why)
			}
			rt.Decisions = append(rt.Decisions, d)
		}
	}
	return rt, nil
}

// proxyOrder re-ranks the candidates in the order the proxy tries them:
// with a mesh, the peer scorer puts cooled-down peers last and weighs what
// is in flight. Candidates are sorted by that rank, the others keep their
// order after them; cooled-down and busy peers get a note.
func (b *Backend) proxyOrder(role string, ds []admin.Decision) {
	if b.a.scorer == nil {
		return
	}
	rank := map[string]int{}
	for i, c := range b.a.scorer.Resolve(role) {
		rank[c.Node] = i
	}
	scores := map[string]proxy.PeerScore{}
	for _, ps := range b.a.scorer.Peers() {
		scores[ps.Node] = ps
	}
	for i := range ds {
		d := &ds[i]
		if r, ok := rank[d.Node]; ok && d.Candidate {
			d.Rank = r
		}
		ps, ok := scores[d.Node]
		if !ok || d.Kind != placement.KindRemote.String() {
			continue
		}
		if ps.InFlight > 0 {
			d.Notes = append(d.Notes, fmt.Sprintf("%d request(s) in flight", ps.InFlight))
		}
		if ps.CooledDown {
			d.Notes = append(d.Notes, fmt.Sprintf("cooled down until %s after %d failure(s): tried last",
				ps.CoolUntil.UTC().Format(time.RFC3339), ps.Failures))
		} else if ps.Failures > 0 {
			d.Notes = append(d.Notes, fmt.Sprintf("%d recent failure(s)", ps.Failures))
		}
	}
	slices.SortStableFunc(ds, func(x, y admin.Decision) int {
		switch {
		case x.Candidate && y.Candidate:
			return x.Rank - y.Rank
		case x.Candidate:
			return -1
		case y.Candidate:
			return 1
		}
		return 0
	})
}

// ---- keyring ----

var errNoMesh = admin.Errorf(admin.ErrNotConfigured, "the mesh is not configured on this node (mesh.bind is empty)")

// Keyring implements admin.Backend.
func (b *Backend) Keyring(context.Context) (admin.Keyring, error) {
	if b.mesh == nil {
		return admin.Keyring{}, errNoMesh
	}
	keys, members := b.mesh.ListKeys()
	out := admin.Keyring{Members: members, Keys: make([]admin.GossipKey, 0, len(keys))}
	for _, k := range keys {
		out.Keys = append(out.Keys, admin.GossipKey{Key: k.Key, Fingerprint: k.Fingerprint.String(), Primary: k.Primary, Nodes: k.Nodes})
	}
	return out, nil
}

// ChangeKeyring implements admin.Backend. The key may be given whole or,
// for use and remove, by its fingerprint.
func (b *Backend) ChangeKeyring(ctx context.Context, by admin.Caller, c admin.KeyringChange) (admin.Keyring, error) {
	if b.mesh == nil {
		return admin.Keyring{}, errNoMesh
	}
	key := strings.TrimSpace(c.Key)
	if c.Op != admin.KeyringInstall {
		if cur, err := b.Keyring(ctx); err == nil {
			for _, k := range cur.Keys {
				if key != "" && k.Fingerprint == key {
					key = k.Key
				}
			}
		}
	}
	raw, err := identity.ParseGossipKey(key)
	if err != nil {
		return admin.Keyring{}, admin.Errorf(admin.ErrInvalid, "%v", err)
	}
	switch c.Op {
	case admin.KeyringInstall:
		err = b.mesh.InstallKey(key)
	case admin.KeyringUse:
		err = b.mesh.UseKey(key)
	case admin.KeyringRemove:
		err = b.mesh.RemoveKey(key)
	default:
		return admin.Keyring{}, admin.Errorf(admin.ErrInvalid, "keyring operation %q", c.Op)
	}
	switch {
	case errors.Is(err, mesh.ErrPrimaryKey):
		return admin.Keyring{}, admin.Errorf(admin.ErrConflict, "%v: make another key primary first (keyring use)", err)
	case errors.Is(err, mesh.ErrKeyNotInstalled):
		return admin.Keyring{}, admin.Errorf(admin.ErrNotFound, "%v", err)
	case err != nil:
		return admin.Keyring{}, err
	}
	b.a.audit.Record(Event{Kind: AuditAdminKeyring, Fields: map[string]string{
		"op": c.Op, "fingerprint": identity.GossipKeyFingerprint(raw).String(), "by": by.String(),
	}})
	return b.Keyring(ctx)
}

// ---- events, instances ----

// Events implements admin.Backend.
func (b *Backend) Events(ctx context.Context, fn func(admin.Event) error) error {
	ch, cancel := b.a.audit.Subscribe(256)
	defer cancel()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-ch:
			if !ok {
				return nil
			}
			if err := fn(admin.Event{Time: e.Time.UTC(), Kind: e.Kind, Role: e.Role, Node: e.Node, Fields: e.Fields}); err != nil {
				return err
			}
		}
	}
}

var errNoProvisioning = admin.Errorf(admin.ErrNotConfigured, "provisioning is not configured on this node (no role has an instance)")

// Instances implements admin.Backend.
func (b *Backend) Instances(context.Context) ([]admin.Instance, error) {
	if b.inst == nil {
		return nil, errNoProvisioning
	}
	list := b.inst.Instances()
	out := make([]admin.Instance, 0, len(list))
	for _, s := range list {
		out = append(out, admin.Instance{
			Role: s.Role, State: string(s.State), Ref: s.Ref, ContainerID: s.ContainerID, Endpoint: s.Endpoint,
			Image: s.Image, Restarts: s.Restarts, LastError: s.LastError, Since: s.Since.UTC(),
		})
	}
	return out, nil
}

// RetryInstance implements admin.Backend.
func (b *Backend) RetryInstance(_ context.Context, by admin.Caller, role string) (admin.Instance, error) {
	if b.inst == nil {
		return admin.Instance{}, errNoProvisioning
	}
	switch err := b.inst.Retry(role); {
	case errors.Is(err, provision.ErrNoInstance):
		return admin.Instance{}, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	case errors.Is(err, provision.ErrNotFailed):
		return admin.Instance{}, admin.Errorf(admin.ErrConflict, "%v: it restarts within its policy by itself", err)
	case err != nil:
		return admin.Instance{}, err
	}
	b.a.audit.Record(Event{Kind: AuditAdminRetry, Role: role, Fields: map[string]string{"by": by.String()}})
	s, _ := b.inst.Instance(role)
	return admin.Instance{
		Role: role, State: string(s.State), Ref: s.Ref, ContainerID: s.ContainerID, Endpoint: s.Endpoint,
		Image: s.Image, Restarts: s.Restarts, LastError: s.LastError, Since: s.Since.UTC(),
	}, nil
}

// InstanceLogs implements admin.Backend.
func (b *Backend) InstanceLogs(_ context.Context, role string, n int) ([]admin.LogLine, error) {
	if b.inst == nil {
		return nil, errNoProvisioning
	}
	if _, ok := b.inst.Instance(role); !ok {
		return nil, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	lines := b.inst.Logs(role, n)
	out := make([]admin.LogLine, 0, len(lines))
	for _, l := range lines {
		out = append(out, admin.LogLine{Time: l.Time.UTC(), Stream: l.Stream, Line: l.Line})
	}
	return out, nil
}

// ---- reload ----

// Reload implements admin.Backend: it re-reads the config file, applies
// the new role policy (with the overrides on top) at once, hands the rest
// to AdminOptions.OnReload, and reports what changed. A config that does
// not load changes nothing.
func (b *Backend) Reload(_ context.Context, by admin.Caller) (admin.ReloadResult, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	old := b.cfg.Load()
	if old.Path() == "" {
		return admin.ReloadResult{}, admin.Errorf(admin.ErrNotConfigured, "this agent runs without a config file (dev mode)")
	}
	next, err := LoadConfig(old.Path())
	if err != nil {
		return admin.ReloadResult{}, admin.Errorf(admin.ErrInvalid, "%v (nothing changed)", err)
	}
	res := admin.ReloadResult{Config: old.Path(), Applied: []string{}, NeedsRestart: []string{}}
	res.Applied, res.NeedsRestart = diffConfig(old, next)
	b.cfg.Store(next)
	if _, err := b.applyLocked(); err != nil {
		return res, err
	}
	if b.onReload != nil {
		if err := b.onReload(old, next, &res); err != nil {
			return res, fmt.Errorf("reload: %w", err)
		}
	}
	res.Generation = b.a.table.Generation()
	b.a.audit.Record(Event{Kind: AuditAdminReload, Fields: map[string]string{
		"by": by.String(), "applied": fmt.Sprint(len(res.Applied)), "needs_restart": fmt.Sprint(len(res.NeedsRestart)),
	}})
	b.log.Info("config reloaded", zap.Strings("applied", res.Applied), zap.Strings("needs_restart", res.NeedsRestart))
	return res, nil
}

// diffConfig lists what changed from old to next: role policy (applied at
// once) and everything else (needs a restart unless OnReload applies it).
func diffConfig(old, next *Config) (applied, restart []string) {
	applied, restart = []string{}, []string{}
	for _, name := range sortedKeys(unionKeys(old.Roles, next.Roles)) {
		o, inOld := old.Roles[name]
		n, inNew := next.Roles[name]
		f := "roles." + name
		switch {
		case !inOld:
			restart = append(restart, f+": added")
			continue
		case !inNew:
			restart = append(restart, f+": removed (its run-time overrides are kept, inactive)")
			continue
		}
		if o.Expose != n.Expose {
			applied = append(applied, fmt.Sprintf("%s.expose: %v -> %v", f, o.Expose, n.Expose))
		}
		if d := listDiff(o.ServeTo, n.ServeTo); d != "" {
			applied = append(applied, f+".serve_to: "+d)
		}
		if d := listDiff(o.AcceptFrom, n.AcceptFrom); d != "" {
			applied = append(applied, f+".accept_from: "+d)
		}
		if o.Port != n.Port {
			restart = append(restart, fmt.Sprintf("%s.port: %d -> %d", f, o.Port, n.Port))
		}
		if o.Upstream != n.Upstream {
			restart = append(restart, fmt.Sprintf("%s.upstream: %q -> %q", f, o.Upstream, n.Upstream))
		}
		if o.Model != n.Model {
			restart = append(restart, fmt.Sprintf("%s.model: %q -> %q", f, o.Model, n.Model))
		}
		if !reflect.DeepEqual(o.Instance, n.Instance) {
			restart = append(restart, f+".instance: changed")
		}
	}
	sections := []struct {
		name     string
		old, new any
	}{
		{"node", old.Node, next.Node}, {"site", old.Site, next.Site}, {"log", old.Log, next.Log},
		{"mesh", old.Mesh, next.Mesh}, {"trust", old.Trust, next.Trust}, {"admin", old.Admin, next.Admin},
		{"proxy", old.Proxy, next.Proxy},
	}
	for _, s := range sections {
		restart = append(restart, structDiff(s.name, reflect.ValueOf(s.old), reflect.ValueOf(s.new))...)
	}
	return applied, restart
}

// listDiff says "+added -removed" between two node lists ("" if equal as
// sets).
func listDiff(old, next []string) string {
	o, n := map[string]bool{}, map[string]bool{}
	for _, x := range old {
		o[x] = true
	}
	for _, x := range next {
		n[x] = true
	}
	var parts []string
	for _, x := range sortedKeys(n) {
		if !o[x] {
			parts = append(parts, "+"+x)
		}
	}
	for _, x := range sortedKeys(o) {
		if !n[x] {
			parts = append(parts, "-"+x)
		}
	}
	return strings.Join(parts, " ")
}

// structDiff lists the yaml fields of a config section that differ.
func structDiff(prefix string, o, n reflect.Value) []string {
	if o.Kind() != reflect.Struct {
		if reflect.DeepEqual(o.Interface(), n.Interface()) {
			return nil
		}
		return []string{fmt.Sprintf("%s: %v -> %v", prefix, o.Interface(), n.Interface())}
	}
	var out []string
	for i := range o.NumField() {
		sf := o.Type().Field(i)
		tag, _, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
		if !sf.IsExported() || tag == "" || tag == "-" {
			continue
		}
		ov, nv := o.Field(i).Interface(), n.Field(i).Interface()
		if reflect.DeepEqual(ov, nv) {
			continue
		}
		switch o.Field(i).Kind() {
		case reflect.Slice, reflect.Map, reflect.Struct, reflect.Pointer:
			out = append(out, prefix+"."+tag+": changed")
		default:
			out = append(out, fmt.Sprintf("%s.%s: %v -> %v", prefix, tag, ov, nv))
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}

func unionKeys[A, B any](a map[string]A, b map[string]B) map[string]bool {
	out := make(map[string]bool, len(a)+len(b))
	for k := range a {
		out[k] = true
	}
	for k := range b {
		out[k] = true
	}
	return out
}

// ---- the admin runtime: store, socket, metrics ----

// Admin is the agent's admin runtime: the state store, the backend, the
// admin socket and the optional metrics port. Create it with OpenAdmin in
// Run before anything else is bound, Serve it once the agent is up, Close
// it on the way out.
type Admin struct {
	a       *Agent
	store   *store.Store
	backend *Backend
	metrics *metrics.Metrics
	ln      *net.UnixListener
	srv     *admin.Server
	log     *zap.Logger

	mu        sync.Mutex
	serving   bool
	metricsHS *http.Server
	metricsLn net.Listener
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
}

// OpenAdmin claims the admin socket (an agent already answering on it makes
// this fail with an error wrapping admin.ErrInUse; a stale socket file is
// removed), opens the state store in the state dir, and applies the
// config's policy with the stored overrides on top. Nothing is answered
// until Serve, but clients may already connect: they wait.
func (a *Agent) OpenAdmin(opts AdminOptions) (*Admin, error) {
	lc := admin.ListenConfig{Path: a.cfg.Admin.Socket, Group: a.cfg.Admin.Group}
	if a.cfg.Admin.PublicRead {
		lc.SocketMode, lc.DirMode = 0o666, 0o755
	}
	ln, err := admin.Listen(lc)
	if err != nil {
		return nil, err
	}
	st, err := store.Open(filepath.Join(a.cfg.Node.StateDir, store.FileName), store.Options{LockTimeout: opts.StoreLockTimeout})
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	b, err := NewBackend(a, st, opts)
	if err != nil {
		_ = st.Close()
		_ = ln.Close()
		return nil, err
	}
	ad := &Admin{a: a, store: st, backend: b, metrics: opts.Metrics, ln: ln, log: a.log.Named("admin")}
	scfg := admin.Config{
		Backend: b,
		Group:   a.cfg.Admin.Group,
		Logger:  ad.log,
		OnRefused: func(c admin.Caller, method, path, why string) {
			a.audit.Record(Event{Kind: AuditAdminRefused, Fields: map[string]string{
				"why": why, "request": method + " " + path, "caller": c.String(),
			}})
		},
	}
	if opts.Metrics != nil {
		scfg.Metrics = opts.Metrics.Handler()
		if opts.Mesh != nil {
			opts.Metrics.SetMesh(meshStats{opts.Mesh})
		}
	}
	if ad.srv, err = admin.New(scfg); err != nil {
		_ = st.Close()
		_ = ln.Close()
		return nil, err
	}
	return ad, nil
}

// Backend is the admin backend (for SIGHUP: Backend().Reload).
func (ad *Admin) Backend() *Backend { return ad.backend }

// Store is the state store (e.g. for the provision intents bucket: DB()).
func (ad *Admin) Store() *store.Store { return ad.store }

// SocketPath is the admin socket.
func (ad *Admin) SocketPath() string { return ad.ln.Addr().String() }

// Serve starts answering the socket, the metrics port (admin.metrics) when
// configured, and counting audited refusals in the metrics. Its goroutines
// end at Close or when ctx ends.
func (ad *Admin) Serve(ctx context.Context) error {
	ad.mu.Lock()
	defer ad.mu.Unlock()
	if ad.serving {
		return errors.New("admin: already serving")
	}
	ad.serving = true
	ctx, ad.cancel = context.WithCancel(ctx)
	if addr := ad.a.cfg.Admin.Metrics; addr != "" && ad.metrics != nil {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			ad.cancel()
			return fmt.Errorf("admin.metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", ad.metrics.Handler())
		ad.metricsLn = ln
		ad.metricsHS = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		ad.wg.Add(1)
		go func() {
			defer ad.wg.Done()
			if err := ad.metricsHS.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				ad.log.Error("metrics listener stopped", zap.Error(err))
			}
		}()
		ad.log.Info("metrics listening", zap.String("addr", ln.Addr().String()))
	}
	ad.wg.Add(1)
	go func() {
		defer ad.wg.Done()
		if err := ad.srv.Serve(ad.ln); err != nil {
			ad.log.Error("admin socket stopped", zap.Error(err))
		}
	}()
	if ad.metrics != nil {
		ch, unsub := ad.a.audit.Subscribe(1024)
		ad.wg.Add(1)
		go func() {
			defer ad.wg.Done()
			defer unsub()
			ad.countRefusals(ctx, ch)
		}()
	}
	ad.wg.Add(1)
	go func() {
		defer ad.wg.Done()
		<-ctx.Done()
		ad.stopServers()
	}()
	ad.log.Info("admin socket ready", zap.String("socket", ad.SocketPath()))
	return nil
}

// MetricsAddr is the bound metrics address, when serving one.
func (ad *Admin) MetricsAddr() (net.Addr, bool) {
	ad.mu.Lock()
	defer ad.mu.Unlock()
	if ad.metricsLn == nil {
		return nil, false
	}
	return ad.metricsLn.Addr(), true
}

func (ad *Admin) countRefusals(ctx context.Context, ch <-chan Event) {
	// Serve subscribes once, so the history replayed at subscription
	// (refusals during start-up) is counted once too.
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-ch:
			if !ok {
				return
			}
			if reason, ok := refusalReason(e); ok {
				ad.metrics.Refused(reason)
			}
		}
	}
}

// refusalReason is the metrics label of an audited refusal. The mesh's
// own refusals are left out: it counts them itself (every one, where its
// audit is rate-limited) and they are exported as
// infermesh_mesh_refusals_total. Admin refusals carry the caller in their
// why, so they get one fixed label.
func refusalReason(e Event) (string, bool) {
	switch {
	case !strings.HasSuffix(e.Kind, ".refused") || strings.HasPrefix(e.Kind, "mesh."):
		return "", false
	case e.Kind == AuditAdminRefused:
		return "admin_forbidden", true
	case e.Fields["why"] != "":
		return e.Fields["why"], true
	}
	return e.Kind, true
}

func (ad *Admin) stopServers() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = ad.srv.Shutdown(ctx)
	ad.mu.Lock()
	hs := ad.metricsHS
	ad.mu.Unlock()
	if hs != nil {
		_ = hs.Shutdown(ctx)
	}
}

// Close stops the socket and the metrics port (ending event streams), waits
// for their goroutines and closes the store. It is idempotent.
func (ad *Admin) Close() error {
	ad.closeOnce.Do(func() {
		ad.mu.Lock()
		cancel := ad.cancel
		serving := ad.serving
		ad.mu.Unlock()
		if cancel != nil {
			cancel()
		}
		ad.stopServers()
		if !serving {
			_ = ad.ln.Close() // Serve never took it over
		}
		ad.wg.Wait()
		ad.closeErr = ad.store.Close()
	})
	return ad.closeErr
}

// meshStats adapts the mesh to metrics.MeshSource.
type meshStats struct{ m MeshAPI }

func (s meshStats) PeerStates() map[string]int {
	out := map[string]int{"admitted": 0, "not_admitted": 0}
	for _, p := range s.m.Members() {
		switch {
		case p.Self:
		case p.Admitted:
			out["admitted"]++
		default:
			out["not_admitted"]++
		}
	}
	return out
}

func (s meshStats) Refusals() map[string]uint64 { return s.m.Refusals() }
