package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/store"
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
	reconcile(snap.Allow, p.accept, func(role, node string, on bool) {
		t.AllowRemoteNode(role, node, on)
		if on && b.mesh != nil {
			// An advert heard before this (a peer's push/pull at start-up
			// comes before the stored policy) is in placement now, not at
			// the peer's next refresh.
			b.mesh.ReofferUnlisted(role, node)
		}
	})

	if b.mesh != nil {
		// Signed statements first: the mesh keeps the newest it holds
		// (those it heard since are newer than the store's, or equal).
		var signed []*identity.Revocation
		for _, o := range ovs {
			if o.Kind != store.KindSignedRevoke {
				continue
			}
			r, err := identity.ParseRevocation(o.Statement)
			if err != nil {
				b.log.Warn("a stored signed revocation does not parse; ignored", zap.String("subject", o.Node), zap.Error(err))
				continue
			}
			signed = append(signed, r)
		}
		if err := b.mesh.LoadRevocations(signed); err != nil {
			b.log.Warn("stored signed revocations not in force", zap.Error(err))
		}
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
			if _, err := identity.ParseNodeKey(k.Node); err != nil {
				return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%q is neither a node name nor a public key", k.Node)
			}
		}
		if c.Statement != "" {
			return b.setSignedRevocation(by, k.Node, c)
		}
		if !c.On && slices.Contains(cfg.Trust.Revoked, k.Node) {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrConflict, "%q is revoked by the config file (trust.revoked); edit it and reload", k.Node)
		}
		if b.mesh == nil {
			note = "no mesh on this node: recorded, and applied once the mesh is configured"
		} else if r, ok := b.mesh.Revocation(k.Node); ok && r.Revoked && !c.On {
			return admin.PolicyResult{}, admin.Errorf(admin.ErrConflict,
				"%s is revoked by a statement signed by the authority (serial %d), which every node holds: lift it with `infermesh unrevoke %s --authority-key FILE`",
				k.Node, r.Serial, k.Node)
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
	if k.Kind == store.KindRevoke && b.mesh != nil {
		if c.On {
			// The revoked node still holds the gossip key: rotate it, to
			// the admitted nodes only.
			note = localOnly(cfg, k.Node) + " " + b.rotateGossipKey(by, "revoked "+k.Node)
		} else {
			note = joinNotes(note, b.bringBack(k.Node, nil))
		}
	}
	return admin.PolicyResult{Override: toAdminOverride(o, true), Changed: changed, Note: note}, nil
}

// localOnly is what a revocation without the authority's signature does,
// plainly: it holds on this node, and nowhere else.
func localOnly(cfg *Config, node string) string {
	if strings.TrimSpace(cfg.Trust.Authority) == "" {
		return fmt.Sprintf("revoked on this node only: other nodes still admit %s (and take keyring changes from it) until it is revoked on each of them; with trust by an authority, `revoke --authority-key` revokes it everywhere.", node)
	}
	return fmt.Sprintf("revoked on this node only: other nodes still admit %s (and take keyring changes from it); to revoke it on every node, sign it: `infermesh revoke %s --authority-key FILE`.", node, node)
}

func joinNotes(notes ...string) string {
	var out []string
	for _, n := range notes {
		if n != "" {
			out = append(out, n)
		}
	}
	return strings.Join(out, "; ")
}

// setSignedRevocation takes a revocation, or its lifting, signed by the
// authority (c.Statement) about subject: the mesh holds it if it is newer
// than what it holds, the state store keeps it, and it goes to every
// admitted peer over QUIC (and by gossip). A revocation then rotates the
// gossip key away from the subject; a lifting gives the subject the
// keyring back.
func (b *Backend) setSignedRevocation(by admin.Caller, subject string, c admin.PolicyChange) (admin.PolicyResult, error) {
	cfg := b.cfg.Load()
	if b.mesh == nil {
		return admin.PolicyResult{}, errNoMesh
	}
	if strings.TrimSpace(cfg.Trust.Authority) == "" {
		return admin.PolicyResult{}, admin.Errorf(admin.ErrNotConfigured,
			"node %s trusts no authority (trust.authority is empty), so a signed revocation means nothing to it: revoke without --authority-key, on every node", cfg.Node.Name)
	}
	r, err := identity.ParseRevocation(c.Statement)
	if err != nil {
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "statement: %v", err)
	}
	if r.Subject() != canonicalSubject(subject) {
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "the statement is about %s, not %s", r.Subject(), subject)
	}
	if r.Revoked != c.On {
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "the statement says %s %s, the request the opposite", r.Op(), r.Subject())
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	accepted, err := b.mesh.AcceptRevocation(r, "admin")
	switch {
	case errors.Is(err, identity.ErrBadRevocation):
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "%v: sign it with the key trust.authority names", err)
	case errors.Is(err, mesh.ErrStaleRevocation):
		return admin.PolicyResult{}, admin.Errorf(admin.ErrConflict, "%v", err)
	case err != nil:
		return admin.PolicyResult{}, err
	}
	if err := b.persistRevocationLocked(r.Subject(), by.String()); err != nil {
		return admin.PolicyResult{}, err
	}
	if !r.Revoked {
		// The operator lifts the local revocation too, if there is one.
		if _, _, err := b.store.Delete(store.Key{Kind: store.KindRevoke, Node: r.Subject()}); err != nil {
			return admin.PolicyResult{}, err
		}
	}
	if _, err := b.applyLocked(); err != nil {
		return admin.PolicyResult{}, err
	}
	held, _ := b.mesh.Revocation(r.Subject())
	o := store.Override{Kind: store.KindSignedRevoke, Node: r.Subject(), On: held.Revoked, At: time.Now().UTC(), By: by.String(), Statement: held.String()}
	b.a.audit.Record(Event{Kind: AuditAdminPolicy, Node: r.Subject(), Fields: map[string]string{
		"policy": string(store.KindSignedRevoke), "on": fmt.Sprint(r.Revoked), "by": by.String(), "changed": fmt.Sprint(accepted),
		"serial": fmt.Sprint(r.Serial),
	}})
	note := fmt.Sprintf("%s of %s signed by the authority (serial %d): held here", r.Op(), r.Subject(), r.Serial)
	if !accepted {
		note += " already"
	}
	tr := b.a.Transport()
	if tr == nil {
		note += "; the QUIC transport is not running: the other nodes hear it by gossip only"
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), rotateTimeout)
		sp := b.mesh.SpreadRevocation(ctx, tr, r)
		cancel()
		if len(sp.Peers) > 0 {
			note += "; sent over QUIC to " + strings.Join(sp.Peers, ", ")
		} else {
			note += "; no admitted peer to send it to over QUIC"
		}
		if len(sp.Failed) > 0 {
			failed := make([]string, 0, len(sp.Failed))
			for n, e := range sp.Failed {
				failed = append(failed, n+": "+e)
			}
			slices.Sort(failed)
			note += "; not reached over QUIC (they hear it by gossip): " + strings.Join(failed, "; ")
		}
	}
	switch {
	case r.Revoked && accepted:
		note += "; every node that holds it refuses " + r.Subject() + ", its keyring changes included; " + b.rotateGossipKey(by, "revoked "+r.Subject())
	case !r.Revoked:
		note = joinNotes(note, b.bringBack(r.Subject(), r))
	}
	return admin.PolicyResult{Override: toAdminOverride(o, true), Changed: accepted, Note: note}, nil
}

// canonicalSubject is subject (a node name or a base64 key) as statements
// name it.
func canonicalSubject(subject string) string {
	name, key, err := identity.ParseRevocationSubject(subject)
	switch {
	case err != nil:
		return subject
	case key != nil:
		return identity.EncodeKey(key)
	}
	return name
}

// persistRevocationLocked writes the statement the mesh holds about
// subject to the state store (and its mirror), unless it is there
// already. Whatever order statements were accepted in, the store ends
// with the one the mesh holds. b.mu must be held.
func (b *Backend) persistRevocationLocked(subject, by string) error {
	r, ok := b.mesh.Revocation(subject)
	if !ok {
		return nil
	}
	text := r.String()
	ovs, err := b.store.Overrides()
	if err != nil {
		return err
	}
	for _, o := range ovs {
		if o.Kind == store.KindSignedRevoke && o.Node == r.Subject() && o.Statement == text {
			return nil
		}
	}
	_, _, err = b.store.Put(store.Override{Kind: store.KindSignedRevoke, Node: r.Subject(), On: r.Revoked, By: by, Statement: text})
	return err
}

var _ mesh.RevocationSink = (*Backend)(nil)

// RevocationAccepted implements mesh.RevocationSink: every signed
// statement the mesh accepts, from anyone, is kept in the state store,
// so it holds across restarts (an older one replayed after a restart is
// still older than the one kept).
func (b *Backend) RevocationAccepted(n mesh.RevocationNews) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.persistRevocationLocked(n.Revocation.Subject(), "authority via "+n.Via); err != nil {
		b.log.Error("a signed revocation statement is held but not saved: a restart forgets it until a peer sends it again",
			zap.String("subject", n.Revocation.Subject()), zap.Error(err))
	}
}

// AuditKeyringReturned: this node gave a node trusted again (an
// unrevoke) its gossip keyring over QUIC, or could not.
const AuditKeyringReturned = "mesh.keyring.returned"

// bringBackTimeout bounds giving the keyring back to the nodes an
// unrevoke names.
const bringBackTimeout = 20 * time.Second

// bringBack gives the nodes subject names, trusted again, this node's
// gossip keyring over QUIC (the key rotated while they were revoked, so
// they can read no gossip), and the signed lifting when there is one.
// Where that cannot be done, it says exactly what to run on the node.
func (b *Backend) bringBack(subject string, lift *identity.Revocation) string {
	tr := b.a.Transport()
	if tr == nil {
		return b.keyringCommands(subject, errors.New("the QUIC transport is not running here"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), bringBackTimeout)
	defer cancel()
	results := b.mesh.ReturnKeyring(ctx, tr, subject, "unrevoked "+subject)
	if len(results) == 0 {
		return fmt.Sprintf("no node known with %s was given the gossip keyring", subject)
	}
	var notes []string
	for _, res := range results {
		fields := map[string]string{"reason": "unrevoked " + subject}
		if res.Err != nil {
			fields["error"] = res.Err.Error()
			b.a.audit.Record(Event{Kind: AuditKeyringReturned, Node: res.Node, Fields: fields})
			notes = append(notes, b.keyringCommands(res.Node, res.Err))
			continue
		}
		b.a.audit.Record(Event{Kind: AuditKeyringReturned, Node: res.Node, Fields: fields})
		n := fmt.Sprintf("%s was given this node's gossip keyring over QUIC: it reads and speaks the mesh's gossip again", res.Node)
		if lift != nil {
			if err := tr.PushRevocation(ctx, res.Node, lift); err != nil {
				n += fmt.Sprintf(" (the signed lifting did not reach it over QUIC: %v; it hears it by gossip)", err)
			}
		}
		notes = append(notes, n)
	}
	return strings.Join(notes, "; ")
}

// keyringCommands says what to run on node when it could not be given the
// gossip keyring over QUIC.
func (b *Backend) keyringCommands(node string, why error) string {
	path := b.mesh.KeyringPath()
	host, _, err := net.SplitHostPort(b.mesh.GossipAddr())
	if err != nil {
		host = b.mesh.GossipAddr()
	}
	return fmt.Sprintf("%s was not given the gossip key (%v), so it can neither read nor speak the mesh's gossip. "+
		"On %s, run: `scp -p %s:%s %s && systemctl restart infermeshd` (the second path is %s's mesh.gossip_keyring); "+
		"or, once its agent answers, run `infermesh unrevoke %s` here again: it sends the key over QUIC",
		node, why, node, host, path, path, node, node)
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
	res, err := b.mesh.RotateGossipKey(ctx, tr, why)
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
	if store.Kind(f.Kind) == store.KindSignedRevoke {
		return admin.ResetResult{}, admin.Errorf(admin.ErrInvalid,
			"signed revocations are the authority's, not this node's: only a newer signed statement changes one (`infermesh unrevoke NODE --authority-key FILE`)")
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
	return admin.Override{Kind: string(o.Kind), Role: o.Role, Node: o.Node, On: o.On, At: o.At, By: o.By, Active: active, Statement: o.Statement}
}
