package agent

import (
	"context"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
)

// The mesh view (`infermesh mesh`, GET /v0/mesh): every node this agent
// knows, from its own gossip state, with what only a node can say of
// itself (its version, its roles' load now) from the info call over QUIC
// to admitted peers. Nodes not admitted are never asked.

// infoTimeout bounds one view's info calls (they run in parallel);
// infoMaxAge is how long an answer is reused, so a view refreshed every
// second (top, the console) asks each peer at most that often.
const (
	infoTimeout = 2 * time.Second
	infoMaxAge  = 5 * time.Second
)

// nodeInfo is this node's answer to its peers' info calls.
func (a *Agent) nodeInfo() mesh.NodeInfo {
	ni := mesh.NodeInfo{Name: a.table.NodeID(), Version: Version, StartedAt: a.started.UTC(), Roles: []mesh.RoleInfo{}}
	snap := a.table.Snapshot()
	for _, role := range ownRoles(snap) {
		n := a.proxy.LocalInFlight(role)
		ni.Roles = append(ni.Roles, mesh.RoleInfo{Name: role, Model: snap.Locals[role].Model, InFlight: uint32(min(max(n, 0), math.MaxUint32))})
	}
	ni.Uses = a.roleUses()
	return ni
}

// roleUses is, for each configured role, the nodes that serve it to this
// node now, in the proxy's order (this node itself for its instance).
func (a *Agent) roleUses() []mesh.RoleUse {
	var uses []mesh.RoleUse
	for _, role := range a.roleNames() {
		u := mesh.RoleUse{Role: role, Nodes: []string{}}
		for _, c := range a.table.Resolve(role) {
			u.Nodes = append(u.Nodes, c.Node)
		}
		uses = append(uses, u)
	}
	return uses
}

// infoCache keeps the peers' info answers for infoMaxAge.
type infoCache struct {
	mu sync.Mutex
	m  map[string]infoAnswer
}

type infoAnswer struct {
	info mesh.NodeInfo
	err  error
	at   time.Time
}

// get returns node's info, asking it when the kept answer is older than
// infoMaxAge.
func (c *infoCache) lookup(nodes []string, ask func(ctx context.Context, node string) (mesh.NodeInfo, error)) map[string]infoAnswer {
	now := time.Now()
	out := make(map[string]infoAnswer, len(nodes))
	var stale []string
	c.mu.Lock()
	for _, n := range nodes {
		if a, ok := c.m[n]; ok && now.Sub(a.at) < infoMaxAge {
			out[n] = a
		} else {
			stale = append(stale, n)
		}
	}
	c.mu.Unlock()
	if len(stale) == 0 {
		return out
	}
	ctx, cancel := context.WithTimeout(context.Background(), infoTimeout)
	defer cancel()
	answers := make([]infoAnswer, len(stale))
	var wg sync.WaitGroup
	for i, n := range stale {
		wg.Go(func() {
			ni, err := ask(ctx, n)
			answers[i] = infoAnswer{info: ni, err: err, at: time.Now()}
		})
	}
	wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]infoAnswer{}
	}
	for i, n := range stale {
		out[n] = answers[i]
		c.m[n] = answers[i]
	}
	// Forget nodes no longer asked about: the cache holds members only.
	for n := range c.m {
		if !slices.Contains(nodes, n) {
			delete(c.m, n)
		}
	}
	return out
}

// MeshView implements admin.MeshViewer.
func (b *Backend) MeshView(context.Context) (admin.MeshView, error) {
	snap := b.a.table.Snapshot()
	self := snap.NodeID
	view := admin.MeshView{Node: self, Nodes: []admin.MeshNode{}}

	// Every role this node serves or a peer advertises to it, explained
	// once: which node is a candidate for it and why the others are not.
	// The peers' roles come from the adverts the mesh holds, placed or
	// not: a peer not allowlisted for a role is in the view too.
	roles := ownRoles(snap)
	var held []mesh.HeldAdvert
	if b.mesh != nil {
		held = b.mesh.HeldAdverts()
	}
	byNode := map[string][]mesh.HeldAdvert{}
	for _, h := range held {
		byNode[h.Origin] = append(byNode[h.Origin], h)
		if !slices.Contains(roles, h.Role) {
			roles = append(roles, h.Role)
		}
	}
	decisions := map[[2]string]placement.Decision{}
	for _, role := range roles {
		for _, d := range b.a.table.Explain(role) {
			decisions[[2]string{role, d.Node}] = d
		}
	}
	meshRole := func(role, node, model string, load uint32, c placement.Capacity) admin.MeshRole {
		mr := admin.MeshRole{Name: role, Model: model, Load: load, Capacity: adminCapacity(c)}
		if d, ok := decisions[[2]string{role, node}]; ok {
			mr.ServesUs = d.Candidate
			for _, r := range d.Reasons {
				mr.Why = append(mr.Why, string(r))
			}
		}
		return mr
	}

	selfNode := admin.MeshNode{Name: self, State: admin.PeerSelf, Scope: "full", Version: Version, Roles: []admin.MeshRole{}, Uses: meshUses(b.a.roleUses())}
	started := b.a.started.UTC()
	selfNode.StartedAt = &started
	for _, role := range ownRoles(snap) {
		mr := meshRole(role, self, snap.Locals[role].Model, snap.LocalLoad[role], snap.LocalCap[role])
		n := uint32(min(max(b.a.proxy.LocalInFlight(role), 0), math.MaxUint32))
		mr.InFlight = &n
		selfNode.Roles = append(selfNode.Roles, mr)
	}
	if b.mesh == nil {
		view.Nodes = append(view.Nodes, selfNode)
		return view, nil
	}

	members := b.mesh.Members()
	var ask []string
	for _, m := range members {
		if !m.Self && m.Admitted {
			ask = append(ask, m.Name)
		}
	}
	var infos map[string]infoAnswer
	if tr := b.a.Transport(); tr != nil && len(ask) > 0 {
		infos = b.a.infos.lookup(ask, tr.Info)
	}
	for _, m := range members {
		if m.Self {
			if m.Scope != 0 {
				selfNode.Scope = m.Scope.String()
			}
			selfNode.CertExpires = timePtr(m.CertExpires)
			view.Nodes = append(view.Nodes, selfNode)
			continue
		}
		n := admin.MeshNode{Name: m.Name, State: admin.PeerNotAdmitted, Why: m.Why, Roles: []admin.MeshRole{}}
		if m.Admitted {
			n.State = admin.PeerAdmitted
		}
		if m.Scope != 0 {
			n.Scope = m.Scope.String()
		}
		n.CertExpires = timePtr(m.CertExpires)
		n.RTTMillis = float64(m.RTT.Microseconds()) / 1000
		heard := m.Heard
		inFlight := map[string]uint32{}
		if ans, ok := infos[m.Name]; ok {
			if ans.err != nil {
				n.InfoError = ans.err.Error()
			} else {
				n.Version = ans.info.Version
				n.StartedAt = timePtr(ans.info.StartedAt.UTC())
				for _, r := range ans.info.Roles {
					inFlight[r.Name] = r.InFlight
				}
				n.Uses = meshUses(ans.info.Uses)
			}
		}
		for _, h := range byNode[m.Name] {
			if h.Received.After(heard) {
				heard = h.Received
			}
			mr := meshRole(h.Role, m.Name, h.Advert.Model, h.Advert.Load, h.Advert.Capacity)
			if h.Unlisted && len(mr.Why) == 0 {
				mr.Why = []string{string(placement.ReasonNotAllowlisted)}
			}
			if v, ok := inFlight[h.Role]; ok {
				mr.InFlight = &v
			}
			n.Roles = append(n.Roles, mr)
		}
		n.LastHeard = timePtr(heard)
		view.Nodes = append(view.Nodes, n)
	}
	for _, r := range b.mesh.RefusedNodes() {
		seen := r.LastSeen.UTC()
		view.Nodes = append(view.Nodes, admin.MeshNode{Name: r.Name, State: admin.PeerRefused, Why: r.Why, LastHeard: &seen, Roles: []admin.MeshRole{}})
	}
	return view, nil
}

func meshUses(us []mesh.RoleUse) []admin.MeshUse {
	out := make([]admin.MeshUse, 0, len(us))
	for _, u := range us {
		out = append(out, admin.MeshUse{Role: u.Role, Nodes: u.Nodes})
	}
	return out
}

// timePtr is t in UTC, nil when zero.
func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}
