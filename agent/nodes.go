package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"go.uber.org/zap"
	"golang.org/x/crypto/ssh"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/provision/node"
	"github.com/infermesh/infermesh/store"
)

// Node bootstrap wiring: the node manager over this agent's state store,
// mesh view, Docker engine and SSH key; the admin API's node routes; the
// audit of every stage.

// BootstrapKeyFile is the agent's SSH key (in the state dir): hosts that
// authorize it may be bootstrapped by this agent.
const BootstrapKeyFile = "bootstrap_ssh_key"

// Audit kinds of node bootstrap: every stage of every node, and the end of
// each add and remove.
const (
	AuditNodeStage     = "node.stage"
	AuditNodeConverged = "node.converged"
	AuditNodeFailed    = "node.failed"
	AuditNodeRemoved   = "node.removed"
)

// NodeOptions tune node bootstrap; Options.NodeTuning changes them (tests
// use short timeouts and binaries they built).
type NodeOptions struct {
	// AgentBinary is the static infermeshd uploaded to new nodes.
	// Default: this executable.
	AgentBinary string
	// DemoBinary is the demo model installed by `node add --demo`.
	// Default: infermesh-demo beside AgentBinary.
	DemoBinary string
	// CLIBinary is the static infermesh CLI installed beside the agent on
	// every new node. Default: infermesh beside AgentBinary.
	CLIBinary string
	// Image is the default node image of docker nodes. Default: the node
	// image of this build's recipe (make node-image).
	Image string
	// JoinTimeout and PollInterval: see node.ManagerConfig.
	JoinTimeout, PollInterval time.Duration
	// SSH tunes the SSH client (its Signer is the agent's bootstrap key).
	SSH node.SSHConfig
}

// nodes is the running node bootstrap.
type nodes struct {
	mgr        *node.Manager
	signer     ssh.Signer
	docker     *provision.DockerClient
	membership meshMembership
	opts       NodeOptions
}

// startNodes builds node bootstrap over the state store and the mesh.
func (a *Agent) startNodes(st *store.Store, m *mesh.Mesh) (*nodes, error) {
	opts := NodeOptions{Image: nodeimage.Tag()}
	if exe, err := os.Executable(); err == nil {
		opts.AgentBinary = exe
	}
	if a.opts.NodeTuning != nil {
		a.opts.NodeTuning(&opts)
	}
	if opts.DemoBinary == "" && opts.AgentBinary != "" {
		opts.DemoBinary = filepath.Join(filepath.Dir(opts.AgentBinary), "infermesh-demo")
	}
	if opts.CLIBinary == "" && opts.AgentBinary != "" {
		opts.CLIBinary = filepath.Join(filepath.Dir(opts.AgentBinary), "infermesh")
	}
	signer, err := node.LoadOrCreateSigner(filepath.Join(a.config().Node.StateDir, BootstrapKeyFile), "infermesh-bootstrap@"+a.config().Node.Name)
	if err != nil {
		return nil, fmt.Errorf("bootstrap ssh key: %w", err)
	}
	sshCfg := opts.SSH
	sshCfg.Signer = signer
	clients, err := node.NewSSHClients(sshCfg)
	if err != nil {
		return nil, err
	}
	intents, err := node.NewBoltIntents(st)
	if err != nil {
		return nil, err
	}
	docker, err := provision.NewDockerClient()
	if err != nil {
		return nil, err
	}
	dl, err := node.NewDockerLease(docker, node.DockerLeaseConfig{Site: a.config().Site, Owner: a.config().Node.Name, AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}})
	if err != nil {
		docker.Close()
		return nil, err
	}
	sl, err := node.NewSSHLease(clients)
	if err != nil {
		docker.Close()
		return nil, err
	}
	mm := meshMembership{m: m, t: a.table}
	mgr, err := node.NewManager(node.ManagerConfig{
		Intents: intents, Leases: []node.Lease{dl, sl}, Clients: clients, Membership: mm,
		JoinTimeout: opts.JoinTimeout, PollInterval: opts.PollInterval,
		LogDir:     filepath.Join(a.config().Node.StateDir, "nodes"),
		OnProgress: a.auditNode,
		Logger:     a.log.Named("nodes"),
	})
	if err != nil {
		docker.Close()
		return nil, err
	}
	return &nodes{mgr: mgr, signer: signer, docker: docker, membership: mm, opts: opts}, nil
}

// recover tears down what an add cut short by a crash or a stop left,
// then drops the accept_from overrides of adds that left no node.
func (n *nodes) recover(ctx context.Context, log *zap.Logger, b *Backend) {
	done, err := n.mgr.Recover(ctx)
	if len(done) > 0 {
		log.Info("tore down nodes whose add did not finish", zap.Strings("nodes", done))
	}
	if err != nil {
		log.Error("tearing down unfinished nodes", zap.Error(err))
	}
	recs, err := n.mgr.List()
	if err != nil {
		log.Error("listing nodes", zap.Error(err))
		return
	}
	recorded := map[string]bool{}
	for _, r := range recs {
		recorded[r.Spec.Name] = true
	}
	b.dropOrphanNodeOverrides(recorded)
}

// close ends the adds in flight (each tears its node down) and releases
// the Docker client.
func (n *nodes) close() {
	n.mgr.Close()
	n.docker.Close()
}

// auditNode records every stage and the end of every add and remove; a
// connect retried is not (the failure that ends the retries names them),
// so a host that is down does not flood the audit.
func (a *Agent) auditNode(p node.Progress) {
	if p.Attempt > 0 {
		return
	}
	fields := map[string]string{"phase": string(p.Phase), "run": strconv.FormatUint(p.Run, 10)}
	if p.Stage != "" {
		fields["stage"] = string(p.Stage)
	}
	if p.Message != "" {
		fields["message"] = p.Message
	}
	kind := AuditNodeStage
	switch {
	case p.Kind == node.ProgressFailed:
		kind = AuditNodeFailed
	case p.Kind == node.ProgressDone && p.Phase == node.PhaseDestroyed:
		kind = AuditNodeRemoved
	case p.Kind == node.ProgressDone:
		kind = AuditNodeConverged
	}
	a.audit.Record(Event{Kind: kind, Node: p.Node, Fields: fields})
}

// meshMembership is node.Membership over this agent's memberlist view
// and placement table.
type meshMembership struct {
	m *mesh.Mesh
	t *placement.Table
}

var _ node.Membership = meshMembership{}

func (mm meshMembership) Member(name string) (node.MemberState, bool) {
	for _, p := range mm.m.Members() {
		if p.Name == name && !p.Self {
			return node.MemberState{PublicKey: identity.EncodeNodeKey(p.PublicKey), Admitted: p.Admitted, Why: p.Why}, true
		}
	}
	return node.MemberState{}, false
}

func (mm meshMembership) Advertises(nodeName, role string) bool {
	for _, r := range mm.t.Snapshot().Remotes {
		if r.Node == nodeName && r.Role == role && r.Fresh {
			return true
		}
	}
	return false
}
