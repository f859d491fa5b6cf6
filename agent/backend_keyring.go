package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
)

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
	if c.Op == admin.KeyringRotate {
		note := b.rotateGossipKey(by, "keyring rotate")
		k, err := b.Keyring(ctx)
		k.Note = note
		return k, err
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

var _ admin.MeshBackend = (*Backend)(nil)

// AuditAdminJoin records `infermesh join`.
const AuditAdminJoin = "admin.join"

// Join implements admin.MeshBackend.
func (b *Backend) Join(ctx context.Context, by admin.Caller, req admin.JoinRequest) (admin.JoinResult, error) {
	if b.mesh == nil {
		return admin.JoinResult{}, errNoMesh
	}
	for _, a := range req.Addrs {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return admin.JoinResult{}, admin.Errorf(admin.ErrInvalid, "address %q: want host:port (%v)", a, err)
		}
	}
	n, err := b.mesh.JoinNow(req.Addrs)
	b.a.audit.Record(Event{Kind: AuditAdminJoin, Fields: map[string]string{
		"addrs": strings.Join(req.Addrs, ","), "contacted": fmt.Sprint(n), "by": by.String(),
	}})
	switch {
	case errors.Is(err, mesh.ErrJoinRefused):
		return admin.JoinResult{}, admin.Errorf(admin.ErrConflict, "%v", err)
	case err != nil:
		return admin.JoinResult{}, admin.Errorf(admin.ErrConflict, "no address answered: %v (the agent keeps trying them)", err)
	}
	out := admin.JoinResult{Contacted: n}
	for _, p := range b.mesh.Members() {
		out.Members = append(out.Members, p.Name)
	}
	return out, nil
}
