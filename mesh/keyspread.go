package mesh

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
)

// Cluster-wide keyring changes. The gossip key is what lets a node read and
// speak gossip, and every node holds it, revoked ones included until it
// changes. A rotation makes a new key, installs it on this node and on every
// admitted live peer, makes it primary everywhere, then keeps only it
// everywhere (every other key is removed, whoever installed it). The new
// key travels only over the QUIC transport, to peers whose pinned key is
// admitted now: a revoked node never receives it, and once the old key is
// removed everywhere its gossip is dropped and it can read none.
//
// Who may change a node's keyring: its operator (the admin socket), and
// over QUIC a peer that this node vouches for now with full scope and that
// no revocation this node knows of covers (trust.revoked, a run-time
// revocation, a statement signed by an authority): MayChangeKeyring. Each
// change names its reason and the rotation it belongs to (the fingerprint
// of the key the rotation made primary), and is audited where it lands,
// with the sender, whether it was applied or refused (OnKeyring).

// Keyring operations, as sent to peers.
const (
	KeyringOpInstall = "install"
	KeyringOpUse     = "use"
	KeyringOpRemove  = "remove"
	// KeyringOpRetain keeps only the Keep keys (the primary among them)
	// and removes every other.
	KeyringOpRetain = "retain"
)

// KeyringOp is one keyring change sent to a peer.
type KeyringOp struct {
	Op  string `json:"op"`
	Key string `json:"key,omitempty"` // base64: install, use, remove
	// Keep are the keys retain keeps (base64).
	Keep []string `json:"keep,omitempty"`
	// Reason says why ("revoked c", "keyring rotate", "unrevoked b").
	Reason string `json:"reason"`
	// Rotation names the rotation the change belongs to: the fingerprint
	// of the key it makes (or made) primary.
	Rotation string `json:"rotation"`
}

// fingerprints names the keys op is about, never the keys themselves.
func (op KeyringOp) fingerprints() []string {
	var out []string
	for _, k := range append([]string{op.Key}, op.Keep...) {
		if raw, err := identity.ParseGossipKey(k); err == nil {
			out = append(out, identity.GossipKeyFingerprint(raw).String())
		}
	}
	return out
}

// KeyringEvent is a keyring change a peer sent this node, applied or not,
// for the audit (TransportConfig.OnKeyring). It names keys by fingerprint
// only.
type KeyringEvent struct {
	// Peer is the sender, as its QUIC connection was verified.
	Peer         string
	Op           string
	Fingerprints []string
	Reason       string
	Rotation     string
	// Refused says why the sender may not change this node's keyring
	// ("" when it may); Failed why an allowed change failed.
	Refused string
	Failed  string
}

// KeyPusher sends a keyring change to a peer over an authenticated channel
// (the Transport). It must return when ctx ends.
type KeyPusher interface {
	PushKeyring(ctx context.Context, node string, op KeyringOp) error
}

// KeyringChanger applies keyring changes peers send and decides who may
// send them; *Mesh satisfies it.
type KeyringChanger interface {
	InstallKey(key string) error
	UseKey(key string) error
	RemoveKey(key string) error
	RetainKeys(keys []string) error
	// MayChangeKeyring returns nil when node, proved by key on an
	// authenticated channel, may change this node's keyring, else why not.
	MayChangeKeyring(node string, key ed25519.PublicKey) error
}

var (
	_ KeyPusher      = (*Transport)(nil)
	_ KeyringChanger = (*Mesh)(nil)
)

// Why a peer may not change this node's keyring (MayChangeKeyring wraps
// them, naming the evidence).
var (
	ErrKeyringSenderRevoked = errors.New("revoked")
	ErrKeyringSenderScope   = errors.New("not admitted with full scope")
)

// keyringPath is where peers send keyring changes (MayChangeKeyring
// decides whose are applied).
const keyringPath = "/.well-known/infermesh/keyring"

// MayChangeKeyring returns nil when node, proved by key on an
// authenticated channel, may change this node's gossip keyring: it is
// vouched for now with that key and full scope, on the node meta it last
// gossiped (a live member or not: a node bringing back a peer gossip lost
// is not a member there), and no revocation this node knows of covers its
// name or key: trust.revoked, a run-time revocation, or a statement signed
// by an authority. The error names the evidence.
func (m *Mesh) MayChangeKeyring(node string, key ed25519.PublicKey) error {
	m.mu.RLock()
	t := m.trust
	m.mu.RUnlock()
	if ev := t.revocationEvidence(node, key); ev != "" {
		return fmt.Errorf("%w: %s", ErrKeyringSenderRevoked, ev)
	}
	s, known := m.lastKnownScope(node)
	switch {
	case s == 0:
		return fmt.Errorf("%w: %s is not vouched for by this node's trust", ErrKeyringSenderScope, node)
	case !known.Equal(key):
		return fmt.Errorf("%w: %s presented key %s, is known by %s", ErrKeyringSenderScope, node, identity.EncodeNodeKey(key), identity.EncodeNodeKey(known))
	case s != identity.ScopeFull:
		return fmt.Errorf("%w: %s has scope %v", ErrKeyringSenderScope, node, s)
	}
	return nil
}

// RotateResult says how a rotation went.
type RotateResult struct {
	Fingerprint identity.Fingerprint // the new primary key
	Peers       []string             // admitted live peers that hold only the new key now
	Failed      map[string]string    // peers that did not take a step, with why
	Took        time.Duration        // from start until every other key was removed
}

// RotateGossipKey makes a new gossip key the only one on this node and on
// every admitted live peer, sent through p; reason goes with every change
// (the peers audit it). Peers that fail a step are left out of the later
// steps and reported (they can no longer read gossip once the old key is
// gone: bring them back with `keyring install` and a restart). It returns
// an error only when this node's own keyring could not change.
func (m *Mesh) RotateGossipKey(ctx context.Context, p KeyPusher, reason string) (RotateResult, error) {
	start := time.Now()
	key, err := identity.NewGossipKey()
	if err != nil {
		return RotateResult{}, err
	}
	raw, _ := identity.ParseGossipKey(key)
	res := RotateResult{Fingerprint: identity.GossipKeyFingerprint(raw), Failed: map[string]string{}}
	rotation := res.Fingerprint.String()
	peers := m.admittedPeers()
	step := func(op KeyringOp, local func() error) error {
		op.Reason, op.Rotation = reason, rotation
		if err := local(); err != nil {
			return err
		}
		for _, n := range peers {
			if _, failed := res.Failed[n]; failed {
				continue
			}
			if err := p.PushKeyring(ctx, n, op); err != nil {
				res.Failed[n] = fmt.Sprintf("%s: %v", op.Op, err)
				m.log.Warn("a peer did not take the keyring change", zap.String("peer", n), zap.String("op", op.Op), zap.Error(err))
			}
		}
		return nil
	}
	if err := step(KeyringOp{Op: KeyringOpInstall, Key: key}, func() error { return m.InstallKey(key) }); err != nil {
		return res, err
	}
	if err := step(KeyringOp{Op: KeyringOpUse, Key: key}, func() error { return m.UseKey(key) }); err != nil {
		return res, err
	}
	// Every other key goes, not only the ones this node held: a key a
	// peer installed on another (a node revoked since, say) goes too.
	keep := []string{key}
	if err := step(KeyringOp{Op: KeyringOpRetain, Keep: keep}, func() error { return m.RetainKeys(keep) }); err != nil {
		return res, err
	}
	for _, n := range peers {
		if _, failed := res.Failed[n]; !failed {
			res.Peers = append(res.Peers, n)
		}
	}
	res.Took = time.Since(start)
	m.log.Info("gossip key rotated", zap.Stringer("fingerprint", res.Fingerprint), zap.Strings("peers", res.Peers),
		zap.Int("failed", len(res.Failed)), zap.Duration("took", res.Took), zap.String("reason", reason))
	return res, nil
}

// ReturnResult says how giving one node this node's keyring went.
type ReturnResult struct {
	Node       string
	GossipAddr string // where it was last seen in gossip ("" unknown)
	QUICAddr   string
	// Err is nil when the node holds exactly this node's keys now.
	Err error
}

// ReturnKeyring gives the nodes subject names (a node name, or a base64
// key: every node known with it) this node's gossip keyring over p, when
// they are trusted again (a lifted revocation): each installs every key,
// makes this node's primary its primary and removes every other key, so it
// can read and speak the mesh's gossip again, and it is contacted by
// gossip at once. A node gossip lost (it could not read gossip while it
// was revoked) is reached at the address it last gossiped. reason goes
// with every change.
func (m *Mesh) ReturnKeyring(ctx context.Context, p KeyPusher, subject, reason string) []ReturnResult {
	var out []ReturnResult
	for _, node := range m.knownAs(subject) {
		out = append(out, m.returnKeyring(ctx, p, node, reason))
	}
	return out
}

// knownAs lists the peers, live or departed, that subject (a name or a
// base64 key) names; a name not known names itself.
func (m *Mesh) knownAs(subject string) []string {
	name, key, err := identity.ParseRevocationSubject(subject)
	if err != nil {
		return nil
	}
	if key == nil {
		return []string{name}
	}
	m.mu.RLock()
	var out []string
	for _, ps := range []map[string]*peer{m.peers, m.departed} {
		for n, p := range ps {
			if p.meta.key.Equal(key) && !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	m.mu.RUnlock()
	slices.Sort(out)
	return out
}

func (m *Mesh) returnKeyring(ctx context.Context, p KeyPusher, node, reason string) ReturnResult {
	res := ReturnResult{Node: node}
	m.mu.RLock()
	pr := m.peers[node]
	if pr == nil {
		pr = m.departed[node]
	}
	if pr != nil {
		res.GossipAddr, res.QUICAddr = pr.addr, pr.meta.quicAddr
	}
	m.mu.RUnlock()
	if _, _, ok := m.TrustedPeer(node); !ok {
		res.Err = fmt.Errorf("%s is not trusted now, or this node never saw its QUIC address", node)
		return res
	}
	var keys []string
	for _, k := range m.keyring.GetKeys() {
		keys = append(keys, identity.EncodeGossipKey(k))
	}
	raw, _ := identity.ParseGossipKey(keys[0])
	rotation := identity.GossipKeyFingerprint(raw).String()
	var ops []KeyringOp
	for _, k := range slices.Backward(keys) {
		ops = append(ops, KeyringOp{Op: KeyringOpInstall, Key: k})
	}
	ops = append(ops, KeyringOp{Op: KeyringOpUse, Key: keys[0]}, KeyringOp{Op: KeyringOpRetain, Keep: keys})
	for _, op := range ops {
		op.Reason, op.Rotation = reason, rotation
		if err := p.PushKeyring(ctx, node, op); err != nil {
			res.Err = fmt.Errorf("%s: %w", op.Op, err)
			return res
		}
	}
	m.log.Info("gave a node trusted again this node's gossip keyring", zap.String("peer", node), zap.String("rotation", rotation),
		zap.String("reason", reason))
	if res.GossipAddr != "" {
		// Gossip with it now rather than at either side's next rejoin
		// attempt (backoff up to RejoinMaxBackoff).
		addr := res.GossipAddr
		m.spawn(func() {
			if _, err := m.ml.Join([]string{addr}); err != nil {
				m.log.Debug("contacting a node given the keyring", zap.String("peer", node), zap.Error(err))
			}
		})
	}
	return res
}

// KeyringPath is this node's gossip keyring file.
func (m *Mesh) KeyringPath() string { return m.cfg.KeyringPath }

// admittedPeers lists the live peers admitted right now, sorted.
func (m *Mesh) admittedPeers() []string {
	now := m.cfg.Now()
	m.mu.RLock()
	var out []string
	for name, p := range m.peers {
		if s, _ := m.trust.admit(name, p.meta.key, p.meta.cert, p.certOK, now); s != 0 {
			out = append(out, name)
		}
	}
	m.mu.RUnlock()
	slices.Sort(out)
	return out
}

// PushKeyring sends one keyring change to node over QUIC: it implements
// KeyPusher. A node that is trusted but not a live member here (gossip
// lost it) is reached at the address it last gossiped.
func (t *Transport) PushKeyring(ctx context.Context, node string, op KeyringOp) error {
	b, err := json.Marshal(op)
	if err != nil {
		return err
	}
	status, msg, err := t.postTrusted(ctx, node, keyringPath, "application/json", b)
	if err != nil {
		return err
	}
	if status != http.StatusNoContent {
		return fmt.Errorf("%s answered %d: %s", node, status, msg)
	}
	return nil
}

// maxKeyringOp bounds a keyring change's body (retain lists at most
// identity.MaxGossipKeys keys).
const maxKeyringOp = 16 << 10

// serveKeyring applies a keyring change from a verified peer that may make
// it (MayChangeKeyring), and tells OnKeyring of every change, applied or
// refused. It runs before servePeer's admission check so that a refusal
// of a peer no longer trusted is audited as a keyring refusal too.
func (t *Transport) serveKeyring(w http.ResponseWriter, r *http.Request, v *verified) {
	switch {
	case t.cfg.Keyring == nil:
		writePeerError(w, http.StatusNotFound, "not_found_error", "unknown_url", "this node takes no keyring changes")
		return
	case r.Method != http.MethodPost:
		writePeerError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "POST only")
		return
	}
	var op KeyringOp
	if err := json.NewDecoder(io.LimitReader(r.Body, maxKeyringOp)).Decode(&op); err != nil {
		writePeerError(w, http.StatusBadRequest, "invalid_request_error", "invalid_json", err.Error())
		return
	}
	ev := KeyringEvent{Peer: v.node, Op: op.Op, Fingerprints: op.fingerprints(), Reason: op.Reason, Rotation: op.Rotation}
	refuse := func(status int, typ, code, why string) {
		ev.Refused = why
		t.keyringEvent(ev)
		writePeerError(w, status, typ, code, why)
	}
	if err := t.cfg.Keyring.MayChangeKeyring(v.node, v.key); err != nil {
		refuse(http.StatusForbidden, "permission_error", "forbidden", "keyring change refused: "+err.Error())
		return
	}
	if !t.stillValid(v.node, v.key) {
		w.Header().Set(RefusedHeader, "not_admitted")
		refuse(http.StatusForbidden, "permission_error", "forbidden", "this node does not admit you")
		return
	}
	if strings.TrimSpace(op.Reason) == "" || strings.TrimSpace(op.Rotation) == "" {
		refuse(http.StatusBadRequest, "invalid_request_error", "invalid_keyring_change", "a keyring change names its reason and its rotation")
		return
	}
	var err error
	switch op.Op {
	case KeyringOpInstall:
		err = t.cfg.Keyring.InstallKey(op.Key)
	case KeyringOpUse:
		err = t.cfg.Keyring.UseKey(op.Key)
	case KeyringOpRemove:
		err = t.cfg.Keyring.RemoveKey(op.Key)
		if err != nil && errors.Is(err, ErrKeyNotInstalled) {
			err = nil // already gone: the goal holds
		}
	case KeyringOpRetain:
		err = t.cfg.Keyring.RetainKeys(op.Keep)
	default:
		err = fmt.Errorf("unknown keyring operation %q", op.Op)
	}
	if err != nil {
		ev.Failed = err.Error()
		t.keyringEvent(ev)
		writePeerError(w, http.StatusConflict, "invalid_request_error", "keyring", err.Error())
		return
	}
	t.keyringEvent(ev)
	w.WriteHeader(http.StatusNoContent)
}

// keyringEvent logs ev and tells OnKeyring. Refusals are counted
// (keyring_refused) and, like every refusal, told at most once per
// sender and operation every 10s.
func (t *Transport) keyringEvent(ev KeyringEvent) {
	if ev.Refused != "" {
		op := ev.Op
		switch op {
		case KeyringOpInstall, KeyringOpUse, KeyringOpRemove, KeyringOpRetain:
		default:
			op = "unknown" // a sender's made-up names must not grow the limiter
		}
		if !t.refusals.count(AuditQUICRefused, ev.Peer, op, refusedKeyring) {
			return
		}
	}
	fields := []zap.Field{zap.String("peer", ev.Peer), zap.String("op", ev.Op), zap.Strings("fingerprints", ev.Fingerprints),
		zap.String("reason", ev.Reason), zap.String("rotation", ev.Rotation)}
	switch {
	case ev.Refused != "":
		t.log.Warn("keyring change refused", append(fields, zap.String("why", ev.Refused))...)
	case ev.Failed != "":
		t.log.Warn("keyring change by a peer failed", append(fields, zap.String("error", ev.Failed))...)
	default:
		t.log.Info("keyring changed by a peer", fields...)
	}
	if t.cfg.OnKeyring != nil {
		t.cfg.OnKeyring(ev)
	}
}

// refusedKeyring counts keyring changes refused (Transport.Refusals).
const refusedKeyring = "keyring_refused"
