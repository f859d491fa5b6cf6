package placement

import (
	"cmp"
	"maps"
	"slices"
	"strings"
	"time"
)

// IngestAdvertisement takes an infer.<role> advertisement received from
// sender, the node id the advertisement was verified as coming from. It is
// heard (nil) only when, checked in this order:
//
//   - its name has ServicePrefix and a valid role (ReasonBadName, ReasonBadRole);
//   - sender is non-empty and not this node (ReasonBadSender, ReasonFromSelf);
//   - it is the sender's own: ad.Node == sender (ReasonNotOwnAdvert);
//   - there is a mesh (ReasonNoMesh), the sender is admitted
//     (ReasonNotAdmitted) with scope full (ReasonMayNotServe);
//   - this node allowlisted sender for the role (ReasonNotAllowlisted).
//
// Otherwise it returns a *RefusedError with the reason and audits it
// (AuditAdvertRefused). A repeat refreshes our receipt time (the TTL). The
// generation is bumped when the entry is new, says something different, or
// was expired (it starts resolving again).
func (t *Table) IngestAdvertisement(sender string, ad Advert) error {
	role := ad.Role()
	why := t.precheckAdvert(sender, ad)
	if why == "" {
		why = t.storeAdvert(role, sender, ad)
	}
	if why == "" {
		return nil
	}
	if role == "" {
		role = ad.Name
	}
	t.emit([]AuditEvent{{
		Kind: AuditAdvertRefused, Role: role, Node: sender,
		Fields: map[string]string{
			"why":             string(why),
			"name":            ad.Name,
			"advertised_node": ad.Node,
			"consumer":        t.nodeID,
		},
	}})
	return &RefusedError{Reason: why, Role: role, Node: sender}
}

// precheckAdvert runs the checks that need no table state, admission among
// them, without the lock.
func (t *Table) precheckAdvert(sender string, ad Advert) Reason {
	role, ok := strings.CutPrefix(ad.Name, ServicePrefix)
	switch {
	case !ok:
		return ReasonBadName
	case ValidateRole(role) != nil:
		return ReasonBadRole
	case sender == "":
		return ReasonBadSender
	case sender == t.nodeID:
		return ReasonFromSelf
	case ad.Node != sender:
		return ReasonNotOwnAdvert
	case t.admission == nil:
		return ReasonNoMesh
	case !t.admission.IsAdmitted(sender):
		return ReasonNotAdmitted
	case !t.admission.MayServe(sender):
		return ReasonMayNotServe
	}
	return ""
}

func (t *Table) storeAdvert(role, sender string, ad Advert) Reason {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !has(t.allow, role, sender) {
		return ReasonNotAllowlisted
	}
	now := t.now()
	per := t.remote[role]
	if per == nil {
		per = map[string]remoteEntry{}
		t.remote[role] = per
	}
	prev, had := per[sender]
	changed := !had || !prev.ad.sameContent(ad) || !t.fresh(prev.received, now)
	seq := prev.loadSeq
	if !had || prev.ad.Load != ad.Load || prev.ad.Capacity != ad.Capacity {
		t.loadSeq++
		seq = t.loadSeq
	}
	per[sender] = remoteEntry{ad: ad.clone(), received: now, loadSeq: seq}
	if changed {
		t.bumpLocked()
	}
	return ""
}

// ReportLoad takes node's load report for role, from its own answer to a
// request (fresher than its adverts): the load and capacity replace those
// of the advert held until the next advert, which replaces them in turn.
// It does not make the advert fresher, and it is ignored when no advert of
// node for role is held. It does not bump the generation: it changes the
// order of candidates only, as a load in an advert does. It returns the
// entry's new Candidate.LoadSeq, 0 when the report was not taken.
func (t *Table) ReportLoad(role, node string, load uint32, c Capacity) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.remote[role][node]
	if !ok {
		return 0
	}
	t.loadSeq++
	e.ad.Load, e.ad.Capacity, e.loadSeq = load, c, t.loadSeq
	t.remote[role][node] = e
	return e.loadSeq
}

// LocalCapacity is what SetLocalCapacity last set for role.
func (t *Table) LocalCapacity(role string) Capacity {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.localCap[role]
}

// fresh reports whether an advertisement received at received still counts
// at now. Freshness is measured from our receipt only.
func (t *Table) fresh(received, now time.Time) bool {
	return now.Sub(received) <= t.ttl
}

// Withdraw forgets node's advertisement of role (the origin stopped serving
// it). Bumps the generation when there was one.
func (t *Table) Withdraw(role, node string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	per := t.remote[role]
	if _, ok := per[node]; !ok {
		return
	}
	delete(per, node)
	if len(per) == 0 {
		delete(t.remote, role)
	}
	t.bumpLocked()
}

// RemoveNode forgets everything node advertised (it left, died or was
// revoked). Its allowlist entries stay: they are policy, not state. Bumps
// the generation when anything was forgotten.
func (t *Table) RemoveNode(node string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	removed := false
	for role, per := range t.remote {
		if _, ok := per[node]; ok {
			delete(per, node)
			removed = true
			if len(per) == 0 {
				delete(t.remote, role)
			}
		}
	}
	if removed {
		t.bumpLocked()
	}
}

// ExpireStale forgets advertisements whose TTL ran out and returns how many.
// Resolve never returns an expired advertisement whether or not this ran;
// calling it periodically (see NextExpiry) makes the expiry visible as a
// generation bump, so caches keyed on Generation or waiting on Changed learn
// about it.
func (t *Table) ExpireStale() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	n := 0
	for role, per := range t.remote {
		for node, e := range per {
			if !t.fresh(e.received, now) {
				delete(per, node)
				n++
			}
		}
		if len(per) == 0 {
			delete(t.remote, role)
		}
	}
	if n > 0 {
		t.bumpLocked()
	}
	return n
}

// NextExpiry returns when the earliest held advertisement expires (after
// which ExpireStale would forget it); false when none is held.
func (t *Table) NextExpiry() (time.Time, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var next time.Time
	found := false
	for _, per := range t.remote {
		for _, e := range per {
			exp := e.received.Add(t.ttl)
			if !found || exp.Before(next) {
				next, found = exp, true
			}
		}
	}
	return next, found
}

// remoteView is what Resolve and Explain need of one remote entry, copied
// out of the lock so admission can be checked without holding it.
type remoteView struct {
	node        string
	hasAdvert   bool
	ad          Advert
	age         time.Duration
	fresh       bool
	allowlisted bool
}

type roleView struct {
	local     Local
	hasLocal  bool
	localLoad uint32
	localCap  Capacity
	remotes   []remoteView // entries and allowlisted nodes, sorted by node id
}

// view copies role's state under the read lock.
func (t *Table) view(role string) roleView {
	t.mu.RLock()
	defer t.mu.RUnlock()
	now := t.now()
	var v roleView
	v.local, v.hasLocal = t.local[role]
	v.localLoad = t.localLoad[role]
	v.localCap = t.localCap[role]
	for node, e := range t.remote[role] {
		v.remotes = append(v.remotes, remoteView{
			node:        node,
			hasAdvert:   true,
			ad:          e.ad,
			age:         now.Sub(e.received),
			fresh:       t.fresh(e.received, now),
			allowlisted: has(t.allow, role, node),
		})
	}
	for node := range t.allow[role] {
		if _, ok := t.remote[role][node]; !ok && node != t.nodeID {
			v.remotes = append(v.remotes, remoteView{node: node, allowlisted: true})
		}
	}
	slices.SortFunc(v.remotes, func(a, b remoteView) int { return cmp.Compare(a.node, b.node) })
	return v
}

// reasons says why r is not a candidate; empty when it is. Admission is
// asked here, outside the lock, on every call.
func (t *Table) reasons(r remoteView) []Reason {
	var out []Reason
	if !r.allowlisted {
		out = append(out, ReasonNotAllowlisted)
	}
	if !r.hasAdvert {
		out = append(out, ReasonNoAdvert)
	} else if !r.fresh {
		out = append(out, ReasonStale)
	}
	switch {
	case t.admission == nil:
		out = append(out, ReasonNoMesh)
	case !t.admission.IsAdmitted(r.node):
		out = append(out, ReasonNotAdmitted)
	case !t.admission.MayServe(r.node):
		out = append(out, ReasonMayNotServe)
	}
	return out
}

// Resolve returns where role is served, in the order to try: the local
// instance first, then remote nodes whose advertisement is allowlisted,
// fresh (TTL from our receipt) and whose node is admitted with scope full
// (re-checked now, so a revoked node stops resolving at once, before its
// entry is removed) — least Load first, ties by node id. Nil when nothing
// serves role.
func (t *Table) Resolve(role string) []Candidate {
	out := t.Candidates(role)
	if len(out) > 0 && out[0].Kind == KindLocal {
		sortRemotes(out[1:])
	} else {
		sortRemotes(out)
	}
	return out
}

// Candidates is Resolve's candidates, the local instance first, the
// remote ones in no particular order: for a caller that orders them by
// its own rule (the proxy's routing policy auto), which saves the sort.
func (t *Table) Candidates(role string) []Candidate {
	if ValidateRole(role) != nil {
		return nil
	}
	// The cheap checks under the read lock, copying only what a
	// candidate needs; admission, which may cost more, outside it.
	t.mu.RLock()
	now := t.now()
	per := t.remote[role]
	l, hasLocal := t.local[role]
	var out []Candidate
	if hasLocal || len(per) > 0 {
		out = make([]Candidate, 0, len(per)+1)
	}
	if hasLocal {
		out = append(out, Candidate{Kind: KindLocal, Node: t.nodeID, Base: l.Base, Model: l.Model, Capacity: t.localCap[role]})
	}
	start := len(out)
	for node, e := range per {
		if t.fresh(e.received, now) && has(t.allow, role, node) {
			out = append(out, Candidate{Kind: KindRemote, Node: node, Model: e.ad.Model, Load: e.ad.Load, Capacity: e.ad.Capacity, LoadSeq: e.loadSeq})
		}
	}
	t.mu.RUnlock()
	if t.admission == nil {
		out = out[:start] // no mesh: no remote candidate (ReasonNoMesh)
	} else {
		out = slices.DeleteFunc(out, func(c Candidate) bool {
			return c.Kind == KindRemote && !(t.admission.IsAdmitted(c.Node) && t.admission.MayServe(c.Node))
		})
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// sortRemotes orders remote candidates least Load first, ties by node id
// (unique: the order is total, no stable sort needed).
func sortRemotes(c []Candidate) {
	slices.SortFunc(c, func(a, b Candidate) int {
		if d := cmp.Compare(a.Load, b.Load); d != 0 {
			return d
		}
		return cmp.Compare(a.Node, b.Node)
	})
}

// Explain returns a decision for every node known for role: the local
// instance, every received advertisement, and every allowlisted node that
// has not advertised. Candidates come first in Resolve's order, then the
// rest by node id, each with every reason it is not a candidate.
func (t *Table) Explain(role string) []Decision {
	if ValidateRole(role) != nil {
		return nil
	}
	v := t.view(role)
	var cands, rest []Decision
	if v.hasLocal {
		lc := v.localCap
		cands = append(cands, Decision{
			Node: t.nodeID, Kind: KindLocal, Candidate: true,
			Base: v.local.Base, Model: v.local.Model, Load: v.localLoad, Capacity: lc,
		})
	}
	start := len(cands)
	for _, r := range v.remotes {
		d := Decision{
			Node: r.node, Kind: KindRemote, Rank: -1,
			Reasons:   t.reasons(r),
			HasAdvert: r.hasAdvert,
		}
		if r.hasAdvert {
			d.Model, d.Load, d.Age, d.Capacity = r.ad.Model, r.ad.Load, r.age, r.ad.Capacity
		}
		if len(d.Reasons) == 0 {
			d.Candidate = true
			cands = append(cands, d)
		} else {
			rest = append(rest, d)
		}
	}
	slices.SortStableFunc(cands[start:], func(a, b Decision) int {
		if d := cmp.Compare(a.Load, b.Load); d != 0 {
			return d
		}
		return cmp.Compare(a.Node, b.Node)
	})
	for i := range cands {
		cands[i].Rank = i
	}
	return append(cands, rest...)
}

// Snapshot returns a deep copy of the table's state.
func (t *Table) Snapshot() Snapshot {
	t.mu.RLock()
	defer t.mu.RUnlock()
	now := t.now()
	s := Snapshot{
		NodeID:     t.nodeID,
		Generation: t.gen,
		AdvertTTL:  t.ttl,
		Locals:     maps.Clone(t.local),
		LocalLoad:  maps.Clone(t.localLoad),
		LocalCap:   maps.Clone(t.localCap),
		Allow:      setsToSorted(t.allow),
		Serve:      setsToSorted(t.serve),
		Exposed:    slices.Sorted(maps.Keys(t.exposed)),
		ProxyPorts: maps.Clone(t.proxyPorts),
	}
	for role, per := range t.remote {
		for node, e := range per {
			s.Remotes = append(s.Remotes, RemoteEntry{
				Role: role, Node: node, Advert: e.ad.clone(),
				ReceivedAt: e.received, Age: now.Sub(e.received), Fresh: t.fresh(e.received, now),
			})
		}
	}
	slices.SortFunc(s.Remotes, func(a, b RemoteEntry) int {
		return cmp.Or(cmp.Compare(a.Role, b.Role), cmp.Compare(a.Node, b.Node))
	})
	return s
}

func setsToSorted(m map[string]map[string]struct{}) map[string][]string {
	out := make(map[string][]string, len(m))
	for role, set := range m {
		out[role] = slices.Sorted(maps.Keys(set))
	}
	return out
}
