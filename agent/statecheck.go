package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/store"
)

// This file holds what the agent checks of its state dir before it starts:
// a state store that never lies (package store refuses a damaged one; here
// its notes are logged and audited) and a node key that is not silently
// replaced.

// Audit kinds of the start-up checks.
const (
	AuditStoreRepaired = "store.repaired" // Open repaired or reset the store; "what" says how
	AuditNewIdentity   = "identity.new"   // a node that ran before was given a new key
)

// ErrIdentityMissing: the node key is gone on a node that ran before.
var ErrIdentityMissing = errors.New("node key is missing")

// openStore opens the state store, starting over when the operator asked
// (Options.ResetState), and reports what it repaired.
func (a *Agent) openStore(lockTimeout time.Duration) (*store.Store, error) {
	st, err := store.Open(filepath.Join(a.config().Node.StateDir, store.FileName),
		store.Options{LockTimeout: lockTimeout, Reset: a.opts.ResetState})
	if err != nil {
		if !errors.Is(err, store.ErrLocked) && !a.opts.ResetState {
			err = fmt.Errorf("%w (infermeshd -reset-state starts over, keeping the damaged files aside)", err)
		}
		return nil, err
	}
	for _, n := range st.Notes() {
		a.log.Warn("state store", zap.String("what", n))
		a.audit.Record(Event{Kind: AuditStoreRepaired, Fields: map[string]string{"what": n}})
	}
	return st, nil
}

// checkIdentity refuses to start a node that ran before (its state store
// or policy mirror is in the state dir) without its node key: its peers
// trust the old key, and quietly making a new one would hide that the key
// was lost (or taken). The operator says so with NewIdentity.
func (a *Agent) checkIdentity() error {
	if !a.config().Mesh.Enabled() {
		return nil
	}
	dir := a.config().Node.StateDir
	keyPath := filepath.Join(dir, identity.NodeKeyFile)
	if _, err := os.Stat(keyPath); !errors.Is(err, os.ErrNotExist) {
		return nil // there, or unreadable: the mesh reports the latter
	}
	for _, name := range []string{store.FileName, store.MirrorFileName} {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err != nil || st.Size() == 0 {
			continue
		}
		if a.opts.NewIdentity {
			a.log.Warn("node key missing on a node that ran before: making a new one (-new-identity); peers must trust its new public key",
				zap.String("key", keyPath))
			a.audit.Record(Event{Kind: AuditNewIdentity, Node: a.config().Node.Name, Fields: map[string]string{"key": keyPath}})
			return nil
		}
		return fmt.Errorf("%w: %s is gone, but this node ran before (%s is there) and its peers trust the old key: restore the key, or start with -new-identity to make a new one (then have it trusted again: a new certificate or trust.nodes entry)",
			ErrIdentityMissing, keyPath, p)
	}
	return nil
}
