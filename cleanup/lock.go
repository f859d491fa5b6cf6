package cleanup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/infermesh/infermesh/store"
)

// ErrSiteRunning: the site's agent runs on this host (it holds the state
// store, or answers on its admin socket). Stopped-site operations refuse.
var ErrSiteRunning = errors.New("the agent is running")

// StoreLock is the state store's exclusive lock, held for the whole of a
// stopped-site operation: while it is held no agent can start on the state
// dir, and an agent that runs holds it, so taking it proves the site is
// stopped.
type StoreLock struct {
	st *store.Store
}

// LockStore takes the exclusive lock of the state store in stateDir,
// waiting up to timeout. A store held by another process is ErrSiteRunning.
// With create false, a state dir without a store (no agent ever ran there)
// returns nil, nil and creates nothing, for read-only passes.
func LockStore(stateDir string, timeout time.Duration, create bool) (*StoreLock, error) {
	path := filepath.Join(stateDir, store.FileName)
	if !create {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
	}
	st, err := store.Open(path, store.Options{LockTimeout: timeout})
	if errors.Is(err, store.ErrLocked) {
		return nil, fmt.Errorf("%w: its state store %s is locked: stop it first (systemctl stop infermeshd): %w", ErrSiteRunning, path, err)
	}
	if err != nil {
		return nil, err
	}
	return &StoreLock{st: st}, nil
}

// Store is the locked state store, for the runtimes' buckets.
func (l *StoreLock) Store() *store.Store { return l.st }

// Path is the state store file.
func (l *StoreLock) Path() string { return l.st.Path() }

// Close releases the lock. Idempotent.
func (l *StoreLock) Close() error { return l.st.Close() }
