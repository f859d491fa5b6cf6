package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
)

// This file connects the agent to its mesh membership (package mesh): the
// config's trust section in the mesh's form, and starting, joining, leaving
// and closing the membership.

// MeshTrust converts the trust section into the mesh's form, naming the
// field of any key that does not parse.
func (c *Config) MeshTrust() (mesh.TrustConfig, error) {
	var t mesh.TrustConfig
	if a := strings.TrimSpace(c.Trust.Authority); a != "" {
		k, err := identity.ParsePublicKey(a)
		if err != nil {
			return t, fieldErr("trust.authority", "%v", err)
		}
		t.Authorities = append(t.Authorities, k)
	}
	for i, n := range c.Trust.Nodes {
		k, err := identity.ParsePublicKey(n.PublicKey)
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

// certificateText returns this node's admission certificate: the value
// itself, or the contents of the file it names (relative to the state dir).
func (c *Config) certificateText() (string, error) {
	v := strings.TrimSpace(c.Trust.Certificate)
	if v == "" {
		return "", nil
	}
	if _, err := identity.ParseCertificate(v); err == nil {
		return v, nil
	}
	p := v
	if !filepath.IsAbs(p) {
		p = filepath.Join(c.Node.StateDir, p)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fieldErr("trust.certificate", "neither a certificate nor a readable file: %v", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// startMesh creates the node's mesh membership and starts joining in the
// background. It returns nil, nil when no mesh is configured.
func (a *Agent) startMesh(ctx context.Context) (*mesh.Mesh, error) {
	mc := a.cfg.Mesh
	if !mc.Enabled() {
		return nil, nil
	}
	trust, err := a.cfg.MeshTrust()
	if err != nil {
		return nil, err
	}
	cert, err := a.cfg.certificateText()
	if err != nil {
		return nil, err
	}
	quicAdv := mc.QUICAdvertise
	if quicAdv == "" {
		quicAdv = mc.QUIC
	}
	cfg := mesh.DefaultConfig()
	cfg.NodeName = a.cfg.Node.Name
	cfg.StateDir = a.cfg.Node.StateDir
	cfg.Cluster = mc.Cluster
	cfg.BindAddr = mc.Bind
	cfg.AdvertiseAddr = mc.Advertise
	cfg.QUICAddr = quicAdv
	cfg.Join = mc.Join
	cfg.KeyringPath = mc.GossipKeyring
	cfg.Certificate = cert
	cfg.Trust = trust
	cfg.AdvertTTL = mc.AdvertTTL
	cfg.Sink = a.table
	cfg.Audit = a.audit
	cfg.Logger = a.log.Named("mesh")
	if a.opts.MeshTuning != nil {
		a.opts.MeshTuning(&cfg)
	}
	m, err := mesh.New(cfg)
	if err != nil {
		return nil, err
	}
	a.admission.Bind(m)
	return m, nil
}

// joinMesh joins in the background; a permanent refusal is logged loudly
// (the node keeps serving its local roles).
func (a *Agent) joinMesh(ctx context.Context, m *mesh.Mesh) {
	n, err := m.Join(ctx)
	switch {
	case err == nil && n > 0:
		a.audit.Record(Event{Kind: "mesh.joined", Fields: map[string]string{"contacts": fmt.Sprint(n)}})
	case errors.Is(err, mesh.ErrJoinRefused):
		a.log.Error("the mesh refused this node; serving local roles only", zap.Error(err))
		a.audit.Record(Event{Kind: "mesh.join.refused", Fields: map[string]string{"why": err.Error()}})
	case err != nil && ctx.Err() == nil:
		a.log.Error("joining the mesh failed", zap.Error(err))
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
