package agent

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/store"
)

// The admin backend answers the admin socket (package admin serves it),
// one file per area of the API:
//
//	backend.go            what the backend needs of the mesh and provisioning; Backend itself
//	backend_policy.go     allow/deny, serve-to, expose, revoke (local or signed by the authority): overrides over the config
//	backend_status.go     the read views: status, peers, roles, route explanations
//	backend_keyring.go    the gossip keyring: list, install, use, remove
//	backend_events.go     the audit stream
//	backend_instances.go  managed instances: list, logs, retry
//	backend_reload.go     reload: re-read the config file, apply what can change at run time
//	backend_nodes.go      node add, list, remove (`infermesh node`), and the overrides an add makes
//
// Its pure parts have files and tests of their own: policy.go (the config
// with the overrides on top) and configdiff.go (what a reload changes).
// admin.go is the runtime around it: state store, socket, metrics port.

// MeshAPI is what the admin backend needs of the mesh. *mesh.Mesh
// satisfies it. Methods must be safe for concurrent use; the keyring
// changes may block while the change spreads (a few seconds at most).
type MeshAPI interface {
	Members() []mesh.PeerInfo
	GossipAddr() string
	ListKeys() (keys []mesh.KeyStatus, members int)
	InstallKey(key string) error
	UseKey(key string) error
	RemoveKey(key string) error
	Revoke(nameOrKey string) error
	Unrevoke(nameOrKey string) error
	Revoked() []string
	Refusals() map[string]uint64
	JoinNow(addrs []string) (int, error)
	RefusedNodes() []mesh.RefusedNode
	CertificateExpiry() (time.Time, bool)
	RotateGossipKey(ctx context.Context, p mesh.KeyPusher, reason string) (mesh.RotateResult, error)
	// ReturnKeyring gives the nodes a lifted revocation names the gossip
	// keyring; KeyringPath is this node's keyring file.
	ReturnKeyring(ctx context.Context, p mesh.KeyPusher, subject, reason string) []mesh.ReturnResult
	KeyringPath() string
	// Signed revocations: AcceptRevocation takes a new statement,
	// LoadRevocations the state store's, Revocation is the one held about
	// a subject, SpreadRevocation sends one to every admitted peer.
	AcceptRevocation(r *identity.Revocation, via string) (bool, error)
	LoadRevocations(rs []*identity.Revocation) error
	Revocation(subject string) (*identity.Revocation, bool)
	SpreadRevocation(ctx context.Context, p mesh.RevocationPusher, r *identity.Revocation) mesh.SpreadResult
	// ReofferUnlisted puts into placement an advert held but refused as
	// not allowlisted, once the allowlist lets its origin in.
	ReofferUnlisted(role, origin string) bool
	// HeldAdverts lists the peers' fresh adverts held, placed or not.
	HeldAdverts() []mesh.HeldAdvert
}

// InstanceAPI is what the admin backend needs of provisioning.
// *provision.Manager satisfies it. Methods must be safe for concurrent use
// and must not block, FollowLogs aside (it blocks until ctx ends, fn
// fails or the role's instance goes away).
type InstanceAPI interface {
	Instances() []provision.InstanceStatus
	Instance(role string) (provision.InstanceStatus, bool)
	Logs(role string, n int) []provision.LogLine
	FollowLogs(ctx context.Context, role string, n int, fn func(provision.LogLine) error) error
	// Retry starts a given-up instance again (provision.ErrNoInstance,
	// provision.ErrNotFailed).
	Retry(role string) error
	// Stop stops role's instance until Retry (provision.ErrNoInstance).
	Stop(ctx context.Context, role string) error
}

var (
	_ MeshAPI       = (*mesh.Mesh)(nil)
	_ InstanceAPI   = (*provision.Manager)(nil)
	_ admin.Backend = (*Backend)(nil)
)

// Audit kinds of the admin socket.
const (
	AuditAdminPolicy  = "admin.policy"
	AuditAdminPull    = "admin.instance.pull"
	AuditAdminReset   = "admin.policy.reset"
	AuditAdminKeyring = "admin.keyring"
	AuditKeyRotated   = "mesh.keyring.rotated"
	AuditAdminReload  = "admin.reload"
	AuditAdminRefused = "admin.refused"
	AuditAdminRetry   = "admin.instance.retry"
	AuditAdminStop    = "admin.instance.stop"
)

// AdminOptions are the parts of the agent the admin backend reaches that
// the Agent may not have: nil means "not configured" and the API says so.
type AdminOptions struct {
	// Mesh: peers, keyring, revocation. Nil: no mesh on this node.
	Mesh MeshAPI
	// Instances: managed instances and their logs. Nil: no provisioning.
	Instances InstanceAPI
	// Metrics are served at /metrics on the socket and on admin.metrics.
	// Nil: no metrics.
	Metrics *metrics.Metrics
	// parts apply a reload's changes of their class beyond role policy
	// and the live fields (the backend's own): trust, roles, instances
	// (see reloadPart). A class without one waits for a restart.
	parts map[reloadClass]reloadPart
	// StoreLockTimeout bounds the wait for the state store's lock.
	// Default 1s.
	StoreLockTimeout time.Duration
}

// Backend is the agent's implementation of admin.Backend: it reads the
// placement table, the mesh and provisioning, and owns run-time policy
// (config baseline + stored overrides, see package store). Safe for
// concurrent use.
type Backend struct {
	a     *Agent
	store *store.Store
	mesh  MeshAPI
	inst  InstanceAPI
	parts map[reloadClass]reloadPart // by class, the backend's policyPart among them
	log   *zap.Logger

	// mu serializes changes (store write + apply) and reloads.
	mu sync.Mutex
	// cfg is the agent's current config (Agent.cfg), the baseline of
	// run-time policy; Reload stores the next one.
	cfg *atomic.Pointer[Config]
}

// NewBackend returns the backend of a over st, and applies the config's
// policy with the stored overrides on top.
func NewBackend(a *Agent, st *store.Store, opts AdminOptions) (*Backend, error) {
	if a == nil || st == nil {
		return nil, errors.New("admin backend: nil agent or store")
	}
	b := &Backend{a: a, store: st, mesh: opts.Mesh, inst: opts.Instances, log: a.log.Named("admin"), cfg: &a.cfg}
	b.parts = map[reloadClass]reloadPart{classPolicy: policyPart{b}}
	for class, p := range opts.parts {
		b.parts[class] = p
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.applyLocked(); err != nil {
		return nil, err
	}
	return b, nil
}

// sortedKeys returns the keys of m in order: every list the admin API
// returns is sorted, so answers are stable.
func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}

// unionKeys is the set of keys in a or b.
func unionKeys[A, B any](a map[string]A, b map[string]B) map[string]bool {
	out := make(map[string]bool, len(a)+len(b))
	for k := range a {
		out[k] = true
	}
	for k := range b {
		out[k] = true
	}
	return out
}
