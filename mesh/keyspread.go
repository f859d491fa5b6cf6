package mesh

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
)

// Cluster-wide keyring changes. The gossip key is what lets a node read and
// speak gossip, and every node holds it, revoked ones included until it
// changes. A rotation makes a new key, installs it on this node and on every
// admitted live peer, makes it primary everywhere, then removes every other
// key everywhere. The new key travels only over the QUIC transport, to
// peers whose pinned key is admitted now: a revoked node never receives it,
// and once the old key is removed everywhere its gossip is dropped and it
// can read none.

// Keyring operations, as sent to peers.
const (
	KeyringOpInstall = "install"
	KeyringOpUse     = "use"
	KeyringOpRemove  = "remove"
)

// KeyringOp is one keyring change sent to a peer.
type KeyringOp struct {
	Op  string `json:"op"`
	Key string `json:"key"` // base64
}

// KeyPusher sends a keyring change to a peer over an authenticated channel
// (the Transport). It must return when ctx ends.
type KeyPusher interface {
	PushKeyring(ctx context.Context, node string, op KeyringOp) error
}

// KeyringChanger applies keyring changes peers send; *Mesh satisfies it.
type KeyringChanger interface {
	InstallKey(key string) error
	UseKey(key string) error
	RemoveKey(key string) error
}

var (
	_ KeyPusher      = (*Transport)(nil)
	_ KeyringChanger = (*Mesh)(nil)
)

// keyringPath is where peers send keyring changes (verified, full-scope
// peers only).
const keyringPath = "/.well-known/infermesh/keyring"

// RotateResult says how a rotation went.
type RotateResult struct {
	Fingerprint identity.Fingerprint // the new primary key
	Peers       []string             // admitted live peers that hold only the new key now
	Failed      map[string]string    // peers that did not take a step, with why
	Took        time.Duration        // from start until every other key was removed
}

// RotateGossipKey makes a new gossip key the only one on this node and on
// every admitted live peer, sent through p. Peers that fail a step are
// left out of the later steps and reported (they can no longer read gossip
// once the old key is gone: bring them back with `keyring install` and a
// restart). It returns an error only when this node's own keyring could
// not change.
func (m *Mesh) RotateGossipKey(ctx context.Context, p KeyPusher) (RotateResult, error) {
	start := time.Now()
	key, err := identity.NewGossipKey()
	if err != nil {
		return RotateResult{}, err
	}
	raw, _ := identity.ParseGossipKey(key)
	res := RotateResult{Fingerprint: identity.GossipKeyFingerprint(raw), Failed: map[string]string{}}
	var old []string
	for _, k := range m.keyring.GetKeys() {
		old = append(old, identity.EncodeGossipKey(k))
	}
	peers := m.admittedPeers()
	step := func(op KeyringOp, local func(string) error) error {
		if err := local(op.Key); err != nil {
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
	if err := step(KeyringOp{Op: KeyringOpInstall, Key: key}, m.InstallKey); err != nil {
		return res, err
	}
	if err := step(KeyringOp{Op: KeyringOpUse, Key: key}, m.UseKey); err != nil {
		return res, err
	}
	for _, k := range old {
		if err := step(KeyringOp{Op: KeyringOpRemove, Key: k}, m.RemoveKey); err != nil {
			return res, err
		}
	}
	for _, n := range peers {
		if _, failed := res.Failed[n]; !failed {
			res.Peers = append(res.Peers, n)
		}
	}
	res.Took = time.Since(start)
	m.log.Info("gossip key rotated", zap.Stringer("fingerprint", res.Fingerprint), zap.Strings("peers", res.Peers),
		zap.Int("failed", len(res.Failed)), zap.Duration("took", res.Took))
	return res, nil
}

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
// KeyPusher.
func (t *Transport) PushKeyring(ctx context.Context, node string, op KeyringOp) error {
	b, err := json.Marshal(op)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+node+keyringPath, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("%s answered %s: %s", node, resp.Status, bytes.TrimSpace(msg))
	}
	return nil
}

// fullScope is the part of a PeerDirectory that tells full-scope peers
// (the Mesh); a directory without it admits no keyring change.
type fullScope interface{ MayServe(node string) bool }

// serveKeyring applies a keyring change from a verified peer admitted with
// full scope.
func (t *Transport) serveKeyring(w http.ResponseWriter, r *http.Request, peer string) {
	fs, ok := t.dir.(fullScope)
	switch {
	case t.cfg.Keyring == nil:
		writePeerError(w, http.StatusNotFound, "not_found_error", "unknown_url", "this node takes no keyring changes")
		return
	case r.Method != http.MethodPost:
		writePeerError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "POST only")
		return
	case !ok || !fs.MayServe(peer):
		t.refused(&refusalError{why: RefusedNotAdmitted, node: peer, msg: "keyring change from a node not admitted with full scope"}, "")
		writePeerError(w, http.StatusForbidden, "permission_error", "forbidden", "keyring changes are taken from full-scope nodes only")
		return
	}
	var op KeyringOp
	if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&op); err != nil {
		writePeerError(w, http.StatusBadRequest, "invalid_request_error", "invalid_json", err.Error())
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
	default:
		err = fmt.Errorf("unknown keyring operation %q", op.Op)
	}
	if err != nil {
		writePeerError(w, http.StatusConflict, "invalid_request_error", "keyring", err.Error())
		return
	}
	t.log.Info("keyring changed by a peer", zap.String("peer", peer), zap.String("op", op.Op))
	if t.cfg.OnKeyring != nil {
		t.cfg.OnKeyring(peer, op.Op, op.Key)
	}
	w.WriteHeader(http.StatusNoContent)
}
