package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/store"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
)

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
	if k.Kind == store.KindRevoke && c.On && b.mesh != nil {
		// The revoked node still holds the gossip key: rotate it, to the
		// admitted nodes only.
		note = b.rotateGossipKey(by, "revoked "+k.Node)
	}
	return admin.PolicyResult{Override: toAdminOverride(o, true), Changed: changed, Note: note}, nil
}

// rotateTimeout bounds a cluster-wide gossip key rotation.
const rotateTimeout = 30 * time.Second

// rotateGossipKey rotates the gossip key cluster-wide over QUIC, audits it
// and returns what to tell the operator.
func (b *Backend) rotateGossipKey(by admin.Caller, why string) string {
	tr := b.a.Transport()
	if tr == nil {
		return "the gossip key was not rotated: the QUIC transport is not running"
	}
	ctx, cancel := context.WithTimeout(context.Background(), rotateTimeout)
	defer cancel()
	res, err := b.mesh.RotateGossipKey(ctx, tr)
	fields := map[string]string{"why": why, "by": by.String()}
	if err != nil {
		fields["error"] = err.Error()
		b.a.audit.Record(Event{Kind: AuditKeyRotated, Fields: fields})
		b.log.Error("gossip key rotation failed", zap.Error(err))
		return "the gossip key rotation failed: " + err.Error()
	}
	fields["fingerprint"] = res.Fingerprint.String()
	fields["peers"] = strings.Join(res.Peers, ",")
	fields["took"] = res.Took.Round(time.Millisecond).String()
	failed := make([]string, 0, len(res.Failed))
	for n, e := range res.Failed {
		failed = append(failed, n+": "+e)
	}
	slices.Sort(failed)
	if len(failed) > 0 {
		fields["failed"] = strings.Join(failed, "; ")
	}
	b.a.audit.Record(Event{Kind: AuditKeyRotated, Fields: fields})
	msg := fmt.Sprintf("gossip key rotated to %s on this node and %d admitted peer(s) in %v", res.Fingerprint,
		len(res.Peers), res.Took.Round(time.Millisecond))
	if len(failed) > 0 {
		msg += "; not reached (install the new key there by hand): " + strings.Join(failed, "; ")
	}
	return msg
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
