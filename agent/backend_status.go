package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
)

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
			p.PublicKey = identity.EncodeNodeKey(m.PublicKey)
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
	for _, r := range b.mesh.RefusedNodes() {
		p := admin.Peer{Name: r.Name, State: admin.PeerRefused, Why: r.Why, GossipAddr: r.GossipAddr, Roles: []string{}}
		if len(r.PublicKey) > 0 {
			p.PublicKey = identity.EncodeNodeKey(r.PublicKey)
		}
		seen := r.LastSeen.UTC()
		p.LastSeen = &seen
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
	hints := b.roleHints(role, ds)
	if !configured && len(ds) == 0 {
		msg := fmt.Sprintf("role %q is not in the config of node %s and no node advertises it", role, cfg.Node.Name)
		if len(hints) > 0 {
			msg += "; " + strings.Join(hints, "; ")
		}
		return admin.Route{}, admin.Errorf(admin.ErrNotFound, "%s", msg)
	}
	rt := admin.Route{Role: role, Generation: t.Generation(), Decisions: []admin.Decision{}, Hints: hints}
	if b.a.proxy != nil {
		rt.Queue = b.a.proxy.QueueLen(role)
	}
	if r, ok := b.a.cacheHitRatio(role); ok {
		rt.CacheHitRatio = &r
	}
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
		ad.Capacity = adminCapacity(d.Capacity)
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
		if r, ok := b.a.scorer.Refused(d.Node, role); ok {
			d.Notes = append(d.Notes, fmt.Sprintf("its agent refused this role to this node (%s) at %s: tried last",
				r.Why, r.At.UTC().Format(time.RFC3339)))
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

// roleHints names the roles peers advertise (accepted or refused, as the
// table and the recent audit know them) under a name close to role, when
// no peer advertises role itself: "chat" here and "Chat" or "chats" there
// is a typo, not a policy decision.
func (b *Backend) roleHints(role string, ds []placement.Decision) []string {
	for _, d := range ds {
		if d.HasAdvert && d.Kind == placement.KindRemote {
			return nil
		}
	}
	near := map[string]map[string]bool{} // role -> nodes
	add := func(r, node string) {
		if r == role || r == "" || !closeNames(role, r) {
			return
		}
		if near[r] == nil {
			near[r] = map[string]bool{}
		}
		near[r][node] = true
	}
	for _, r := range b.a.table.Snapshot().Remotes {
		add(r.Role, r.Node)
	}
	for _, e := range b.a.audit.Recent() {
		if e.Kind == placement.AuditAdvertRefused {
			add(e.Role, e.Node)
		}
	}
	var out []string
	for _, r := range sortedKeys(near) {
		out = append(out, fmt.Sprintf("role %q is advertised by %s: did you mean it?", r, strings.Join(sortedKeys(near[r]), ", ")))
	}
	return out
}

// closeNames reports whether two role names are likely one name mistyped:
// equal but for case, dashes and underscores, or a small edit apart.
func closeNames(a, b string) bool {
	norm := func(s string) string { return strings.ReplaceAll(strings.ToLower(s), "_", "-") }
	if norm(a) == norm(b) {
		return true
	}
	return editDistance(norm(a), norm(b)) <= max(1, min(len(a), len(b))/4)
}

// adminCapacity is c in the admin API, nil when unknown.
func adminCapacity(c placement.Capacity) *admin.Capacity {
	if !c.Known() {
		return nil
	}
	ac := &admin.Capacity{Slots: c.Slots, Running: c.Running, Waiting: c.Waiting, KVUsage: c.KVUsage}
	if h, ok := c.CacheHitRatio(); ok {
		ac.CacheHitRatio = &h
	}
	return ac
}
