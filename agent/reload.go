package agent

import (
	"context"
	"errors"

	"github.com/infermesh/infermesh/provision"
)

// The agent's reload parts (reloadPart, see configdiff.go): each applies a
// reload's changes of its class to what owns them. Role policy is the
// admin backend's own part (policyPart); a live field needs none.

// reloadParts are the parts Run hands the admin backend.
func (a *Agent) reloadParts() map[reloadClass]reloadPart {
	return map[reloadClass]reloadPart{
		classTrust:    trustPart{a},
		classRole:     rolePart{a},
		classInstance: instancePart{a},
	}
}

// servingRoles is the roles' runtime once Run built every part (nil before).
func (a *Agent) servingRoles() *roleServing {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.serving
}

// provisioning is the instance manager's runtime (nil when none runs).
func (a *Agent) provisioning() *provisioning {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.prov
}

// noManager is why a managed instance's change waits when no instance
// manager runs.
const noManager = "no instance manager runs: the agent starts one when it starts with a managed instance (or one it remembers)"

// managed reports whether role name of c has a managed instance (docker or
// native).
func managed(c *Config, name string) bool {
	r, ok := c.Roles[name]
	return ok && r.Instance != nil && r.Instance.Runtime != provision.RuntimeSimulated
}

// trustPart applies trust to the mesh (mesh.SetTrust): revocations and
// admissions take effect at once. Without a mesh nothing enforces trust:
// the current config holding it is all there is to apply.
type trustPart struct{ a *Agent }

func (trustPart) plan(*Config, *Config, []configChange) (map[string]string, error) { return nil, nil }

func (p trustPart) apply(_, cur *Config, changes []configChange) []reloadFailure {
	m := p.a.Mesh()
	if m == nil || len(changes) == 0 {
		return nil
	}
	trust, err := cur.MeshTrust()
	if err == nil {
		err = m.SetTrust(trust)
	}
	if err != nil {
		return []reloadFailure{{what: "trust", err: err}}
	}
	return nil
}

// rolePart applies roles added and removed, and how a kept one is served
// here: its port, its upstream, its model, a simulated instance
// (roleServing). It compares each role of the old config with the current
// one's, whatever class the change had: a role switched between a static
// upstream and an instance changes fields of both classes.
type rolePart struct{ a *Agent }

func (p rolePart) plan(_, next *Config, changes []configChange) (map[string]string, error) {
	rs := p.a.servingRoles()
	if rs == nil || !rs.running() {
		return nil, errors.New("the agent is starting or stopping; reload once it is ready")
	}
	noProv := p.a.provisioning() == nil
	waits := map[string]string{}
	for _, c := range changes {
		name := c.role()
		if r, ok := next.Roles[name]; ok && r.Instance != nil && r.Instance.Runtime == provision.RuntimeSimulated && p.a.opts.Simulated == nil {
			return nil, errors.New("roles." + name + ".instance.runtime: simulated: this agent has no built-in demo model")
		}
		if noProv && managed(next, name) {
			waits[c.path] = noManager
		}
	}
	return waits, nil
}

func (p rolePart) apply(old, cur *Config, _ []configChange) []reloadFailure {
	rs := p.a.servingRoles()
	var failed []reloadFailure
	fail := func(name string, err error) {
		if err != nil {
			failed = append(failed, reloadFailure{role: name, err: err})
		}
	}
	// Removed roles first, then kept ones (a move binds its new port
	// before it frees the old), then added ones: a port a role gives up
	// is free for another in the same reload.
	for _, name := range sortedKeys(old.Roles) {
		if _, ok := cur.Roles[name]; !ok {
			var spec *provision.InstanceSpec
			if s, ok := old.desiredInstances()[name]; ok {
				spec = &s
			}
			rs.retire(name, spec)
		}
	}
	for _, name := range sortedKeys(old.Roles) {
		if n, ok := cur.Roles[name]; ok {
			fail(name, rs.update(name, n))
		}
	}
	for _, name := range sortedKeys(cur.Roles) {
		if _, ok := old.Roles[name]; !ok {
			fail(name, rs.start(name, cur.Roles[name]))
		}
	}
	return failed
}

// instancePart applies managed instances' specs through the instance
// manager: an instance changed is replaced, one added started, and one
// whose role was removed is removed once the role's port has drained.
type instancePart struct{ a *Agent }

func (p instancePart) plan(old, next *Config, changes []configChange) (map[string]string, error) {
	if p.a.provisioning() != nil {
		return nil, nil
	}
	waits := map[string]string{}
	for _, c := range changes {
		if managed(old, c.role()) || managed(next, c.role()) {
			waits[c.path] = noManager
		}
	}
	return waits, nil
}

func (p instancePart) apply(*Config, *Config, []configChange) []reloadFailure {
	if err := p.a.applyInstances(); err != nil {
		return []reloadFailure{{what: "instances", err: err}}
	}
	return nil
}

// applyInstances makes the instance manager's desired instances the
// current config's, and those of removed roles whose port still drains.
// Nothing without an instance manager.
func (a *Agent) applyInstances() error {
	a.instMu.Lock()
	defer a.instMu.Unlock()
	prov := a.provisioning()
	if prov == nil {
		return nil
	}
	desired := a.config().desiredInstances()
	if rs := a.servingRoles(); rs != nil {
		for role, spec := range rs.retiringInstances() {
			if _, ok := desired[role]; !ok {
				desired[role] = spec
			}
		}
	}
	return prov.mgr.Apply(context.Background(), desired)
}
