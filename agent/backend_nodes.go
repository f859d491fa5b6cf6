package agent

// The admin API's node answers: add (checked against this agent's config
// and mesh, turned into a spec and a plan), remove and list, and the
// accept_from overrides an add makes so that the new node's adverts are
// heard.

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/configs"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision/node"
	"github.com/infermesh/infermesh/store"
)

var _ admin.NodeBackend = (*Backend)(nil)

var errNoNodes = admin.Errorf(admin.ErrNotConfigured, "node bootstrap needs a mesh on this agent (mesh.bind and mesh.quic)")

func (b *Backend) nodes() *nodes {
	b.a.mu.Lock()
	defer b.a.mu.Unlock()
	return b.a.nodes
}

// nodeAddedBy marks the accept_from overrides `node add` makes, so that
// `node remove` takes back those and no other.
const nodeAddedBy = "node add "

// AddNode implements admin.NodeBackend.
func (b *Backend) AddNode(ctx context.Context, by admin.Caller, req admin.NodeAdd, emit func(admin.NodeEvent) error) error {
	rt := b.nodes()
	if rt == nil || b.mesh == nil {
		return errNoNodes
	}
	m := rt.membership.m
	spec, plan, err := b.nodePlan(rt, m, by, req)
	if err != nil {
		return err
	}
	added, err := b.acceptFromNode(spec)
	if err != nil {
		return err
	}
	stream := &heldStream{emit: emit}
	_, err = rt.mgr.Add(ctx, spec, plan, stream.progress)
	if err != nil {
		b.dropNodeOverrides(added)
	}
	stream.end()
	if errors.Is(err, node.ErrExists) {
		return admin.Errorf(admin.ErrConflict, "%v", err)
	}
	return err
}

// heldStream forwards a node's progress to emit but holds its terminal
// event (done or failed) until end: the stream ends only once the agent
// has finished what its end promises (the overrides dropped too).
// Progress comes from the one goroutine running the operation.
type heldStream struct {
	emit     func(admin.NodeEvent) error
	terminal *admin.NodeEvent
}

func (h *heldStream) progress(p node.Progress) {
	e := nodeEvent(p)
	if e.Terminal() {
		h.terminal = &e
		return
	}
	_ = h.emit(e)
}

func (h *heldStream) end() {
	if h.terminal != nil {
		_ = h.emit(*h.terminal)
	}
}

// nodePlan checks an add request against this agent's config and mesh and
// turns it into a spec (stored) and a plan (with the secrets).
func (b *Backend) nodePlan(rt *nodes, m *mesh.Mesh, by admin.Caller, req admin.NodeAdd) (node.Spec, node.Plan, error) {
	cfg := b.cfg.Load()
	bad := func(format string, args ...any) (node.Spec, node.Plan, error) {
		return node.Spec{}, nil, admin.Errorf(admin.ErrInvalid, format, args...)
	}
	if err := validNodeName(req.Name); err != nil {
		return bad("name: %v", err)
	}
	if req.Name == cfg.Node.Name {
		return bad("%q is this agent's own name", req.Name)
	}
	if _, ok := rt.membership.Member(req.Name); ok {
		return node.Spec{}, nil, admin.Errorf(admin.ErrConflict, "a node named %s is already a member of the mesh", req.Name)
	}
	if strings.TrimSpace(cfg.Trust.Authority) == "" {
		return node.Spec{}, nil, admin.Errorf(admin.ErrNotConfigured, "node add needs trust.authority in this agent's config: new nodes are admitted by an admission certificate it signs")
	}
	authPub, err := identity.ParseAuthorityKey(cfg.Trust.Authority)
	if err != nil {
		return bad("trust.authority: %v", err)
	}
	seed, err := base64.StdEncoding.DecodeString(strings.TrimSpace(req.AuthorityKey))
	if err != nil || len(seed) != ed25519.SeedSize {
		return bad("authority_key: want the authority key file's content (a base64 ed25519 seed)")
	}
	authKey := ed25519.NewKeyFromSeed(seed)
	if !authKey.Public().(ed25519.PublicKey).Equal(authPub) {
		return bad("the authority key is not the one trust.authority names: this agent would not admit the node")
	}
	gossip := m.GossipAddr()
	if err := reachable("this agent's gossip address", gossip); err != nil {
		return node.Spec{}, nil, admin.Errorf(admin.ErrNotConfigured, "%v", err)
	}
	quic := cfg.Mesh.QUICAdvertise
	if quic == "" {
		quic = cfg.Mesh.QUIC
	}
	if err := reachable("this agent's QUIC address", quic); err != nil {
		return node.Spec{}, nil, admin.Errorf(admin.ErrNotConfigured, "%v", err)
	}
	ttl := 720 * time.Hour
	if req.CertTTL > 0 {
		ttl = time.Duration(req.CertTTL * float64(time.Second))
	}

	spec := node.Spec{
		Name: req.Name, Run: uint64(time.Now().UnixNano()), Provider: node.Kind(req.Provider),
		Join: []string{gossip}, JoinCredentialRef: node.JoinCredentialRef,
		Created: time.Now().UTC(), By: by.String(),
	}
	switch spec.Provider {
	case node.KindDocker:
		if req.SSH != "" {
			return bad("--ssh is for the ssh provider")
		}
		img := req.Image
		if img == "" {
			img = rt.opts.Image
		}
		spec.Docker = &node.DockerTarget{Image: img, Network: req.Network}
	case node.KindSSH:
		t, err := parseSSHTarget(req.SSH)
		if err != nil {
			return bad("ssh: %v", err)
		}
		t.HostKeys, t.Fingerprints, t.Advertise = req.HostKeys, req.HostKeyFingerprints, req.Advertise
		for _, f := range t.Fingerprints {
			if _, err := node.NormalizeFingerprint(f); err != nil {
				return bad("--host-key-fingerprint: %v", err) // before anything dials the host
			}
		}
		if len(t.HostKeys) == 0 && len(t.Fingerprints) == 0 {
			return bad("no host key pinned for %s: give its known_hosts entry or --host-key-fingerprint", req.SSH)
		}
		spec.SSH = &t
	default:
		return bad("provider %q: want docker or ssh", req.Provider)
	}
	demoModel := "demo"
	for i, r := range req.Roles {
		if err := placement.ValidateRole(r.Name); err != nil {
			return bad("roles[%d]: %v", i, err)
		}
		role := node.Role{Name: r.Name, Port: r.Port, Upstream: r.Upstream, Model: r.Model}
		if role.Port == 0 {
			role.Port = 18080 + i
		}
		switch {
		case role.Upstream != "":
			if err := loopbackBase(role.Upstream); err != nil {
				return bad("role %s: upstream: %v", r.Name, err)
			}
		case req.Demo:
			role.Upstream = "http://" + node.DemoListen
			if role.Model == "" {
				role.Model = demoModel
			}
		default:
			return bad("role %s: no upstream (give one, or --demo)", r.Name)
		}
		_, role.Consumed = cfg.Roles[r.Name]
		spec.Roles = append(spec.Roles, role)
	}
	for i, v := range req.Verify {
		spec.Boot.Verify = append(spec.Boot.Verify, node.Check{Name: fmt.Sprintf("verify[%d] %s", i, v), Command: v})
	}
	keys, _ := m.ListKeys()
	var keyring []string
	for _, k := range keys {
		keyring = append(keyring, k.Key)
	}
	pc := node.PlanConfig{
		Spec: spec, Site: cfg.Site, Cluster: cfg.Mesh.Cluster,
		Bootstrapper: node.Agent{Name: cfg.Node.Name, PublicKey: identity.EncodeNodeKey(m.PublicKey())},
		Authority:    cfg.Trust.Authority,
		Issue: func(_ context.Context, name, pub string) (string, error) {
			k, err := identity.ParseNodeKey(pub)
			if err != nil {
				return "", fmt.Errorf("the key read back from the node: %w", err)
			}
			c, err := identity.IssueCertificate(authKey, name, k, identity.ScopeFull, ttl, time.Now())
			if err != nil {
				return "", err
			}
			return c.String(), nil
		},
		Keyring:     keyring,
		AgentBinary: rt.opts.AgentBinary,
		CLIBinary:   rt.opts.CLIBinary,
		Unit:        configs.InfermeshdUnit,
		Sysusers:    configs.Sysusers,
		User:        configs.User,
		AdminGroup:  configs.AdminGroup,
	}
	if req.Demo {
		pc.DemoBinary, pc.DemoModel = rt.opts.DemoBinary, demoModel
	}
	boot, plan, err := node.NewPlan(pc)
	if err != nil {
		return node.Spec{}, nil, admin.Errorf(admin.ErrNotConfigured, "%v", err)
	}
	spec.Boot = boot
	if err := spec.Validate(); err != nil {
		return bad("%v", err)
	}
	return spec, plan, nil
}

// reachable refuses an address another host cannot reach.
func reachable(what, hostport string) error {
	h, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return fmt.Errorf("%s %q: %w", what, hostport, err)
	}
	ip := net.ParseIP(h)
	kind := ""
	switch {
	case ip == nil:
	case ip.IsLoopback():
		kind = "a loopback address"
	case ip.IsUnspecified():
		kind = "unspecified"
	}
	if kind != "" {
		return fmt.Errorf("%s %s is %s: a new node cannot reach it; bind or advertise the mesh on an address the node reaches (mesh.advertise, mesh.quic_advertise)", what, hostport, kind)
	}
	return nil
}

// parseSSHTarget reads user@host[:port].
func parseSSHTarget(s string) (node.SSHTarget, error) {
	user, hostport, ok := strings.Cut(s, "@")
	if !ok || user == "" || hostport == "" {
		return node.SSHTarget{}, fmt.Errorf("%q: want user@host[:port]", s)
	}
	host, port := hostport, 22
	if h, p, err := net.SplitHostPort(hostport); err == nil {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return node.SSHTarget{}, fmt.Errorf("%q: bad port", s)
		}
		host, port = h, n
	}
	return node.SSHTarget{User: user, Host: host, Port: port}, nil
}

// acceptFromNode lets the new node serve this agent the roles it has
// (accept_from overrides, as `infermesh allow ROLE NODE`), so that its
// adverts are heard. It returns the overrides it made; existing ones are
// left as they are.
func (b *Backend) acceptFromNode(spec node.Spec) ([]store.Key, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ovs, err := b.store.Overrides()
	if err != nil {
		return nil, err
	}
	have := map[store.Key]bool{}
	for _, o := range ovs {
		have[o.Key()] = true
	}
	var added []store.Key
	for _, r := range spec.Roles {
		k := store.Key{Kind: store.KindAcceptFrom, Role: r.Name, Node: spec.Name}
		if !r.Consumed || have[k] {
			continue
		}
		if _, _, err := b.store.Put(store.Override{Kind: k.Kind, Role: k.Role, Node: k.Node, On: true, By: nodeAddedBy + spec.Name + " by " + spec.By}); err != nil {
			return added, err
		}
		added = append(added, k)
	}
	if len(added) > 0 {
		if _, err := b.applyLocked(); err != nil {
			return added, err
		}
	}
	return added, nil
}

func (b *Backend) dropNodeOverrides(keys []store.Key) {
	if len(keys) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, k := range keys {
		if _, _, err := b.store.Delete(k); err != nil {
			b.log.Warn("dropping a node's accept_from override", zap.Error(err))
		}
	}
	if _, err := b.applyLocked(); err != nil {
		b.log.Warn("applying policy", zap.Error(err))
	}
}

// dropOrphanNodeOverrides drops the accept_from overrides `node add` made
// for nodes that are not recorded (an add cut short before its intent was
// stored, or torn down at start).
func (b *Backend) dropOrphanNodeOverrides(recorded map[string]bool) {
	ovs, err := b.store.Overrides()
	if err != nil {
		return
	}
	var keys []store.Key
	for _, o := range ovs {
		if o.Kind == store.KindAcceptFrom && !recorded[o.Node] && strings.HasPrefix(o.By, nodeAddedBy+o.Node+" ") {
			keys = append(keys, o.Key())
		}
	}
	b.dropNodeOverrides(keys)
}

// nodeOverrides are the accept_from overrides `node add` made for name.
func (b *Backend) nodeOverrides(name string) []store.Key {
	ovs, err := b.store.Overrides()
	if err != nil {
		return nil
	}
	var out []store.Key
	for _, o := range ovs {
		if o.Kind == store.KindAcceptFrom && o.Node == name && strings.HasPrefix(o.By, nodeAddedBy+name+" ") {
			out = append(out, o.Key())
		}
	}
	return out
}

// RemoveNode implements admin.NodeBackend.
func (b *Backend) RemoveNode(ctx context.Context, by admin.Caller, name string, emit func(admin.NodeEvent) error) error {
	rt := b.nodes()
	if rt == nil {
		return errNoNodes
	}
	stream := &heldStream{emit: emit}
	defer stream.end()
	_, err := rt.mgr.Remove(ctx, name, stream.progress)
	switch {
	case errors.Is(err, node.ErrUnknown):
		return admin.Errorf(admin.ErrNotFound, "no node %s is recorded on this agent", name)
	case errors.Is(err, node.ErrExists):
		return admin.Errorf(admin.ErrConflict, "%v", err)
	case err != nil:
		return err
	}
	b.dropNodeOverrides(b.nodeOverrides(name))
	b.log.Info("node removed", zap.String("node", name), zap.String("by", by.String()))
	return nil
}

// Nodes implements admin.NodeBackend.
func (b *Backend) Nodes(context.Context) (admin.NodeList, error) {
	rt := b.nodes()
	if rt == nil {
		return admin.NodeList{}, errNoNodes
	}
	recs, err := rt.mgr.List()
	if err != nil {
		return admin.NodeList{}, err
	}
	out := admin.NodeList{BootstrapKey: node.AuthorizedKey(rt.signer.PublicKey()), Nodes: []admin.Node{}}
	for _, r := range recs {
		n := admin.Node{
			Name: r.Spec.Name, Provider: string(r.Spec.Provider), Phase: string(r.Phase), Stage: string(r.Stage),
			Key: r.PublicKey, Failure: r.Failure, Busy: rt.mgr.Busy(r.Spec.Name), Run: r.Spec.Run,
			Created: r.Spec.Created, Updated: r.Updated.UTC(), By: r.Spec.By, Roles: []string{},
		}
		for _, role := range r.Spec.Roles {
			n.Roles = append(n.Roles, role.Name)
		}
		if r.Lease != nil {
			n.Lease, n.Installed = string(r.Lease.ID), len(r.Lease.Installed)
		}
		if r.Endpoint != nil {
			n.Endpoint = r.Endpoint.String()
		}
		switch st, ok := rt.membership.Member(r.Spec.Name); {
		case !ok:
			n.Member = "not a member"
		case st.Admitted:
			n.Member = "admitted"
		default:
			n.Member = "not admitted: " + st.Why
		}
		out.Nodes = append(out.Nodes, n)
	}
	return out, nil
}

func nodeEvent(p node.Progress) admin.NodeEvent {
	e := admin.NodeEvent{Time: p.Time.UTC(), Node: p.Node, Run: p.Run, Kind: p.Kind, Phase: string(p.Phase), Stage: string(p.Stage), Message: p.Message, Attempt: p.Attempt}
	if p.Log != nil {
		e.Stream, e.Seq, e.Line = string(p.Log.Stream), p.Log.Seq, p.Log.Line
	}
	return e
}
