// Package store is the state store: one bbolt database in the state dir
// (state.db) and its policy mirror. It owns the file, its lock, the checks
// of a damaged one and the mirror, and every bucket in it (buckets.go): the
// run-time policy overrides operators make through the admin socket, so
// that they survive a restart, and the records of the packages above it
// (the mesh's peers and sequence numbers, the agent's audit history, the
// instance and node intents), each reached through a typed handle on its
// own bucket (Bucket); and the proxy's clients (clients.go), kept like the
// policy, with the mirror. It imports nothing of ours.
//
// # Precedence
//
// The configuration file is the baseline. A run-time change is recorded as
// an Override of one (kind, role, node) fact with its value (on or off), when
// it was made and by whom. On start and on every reload the agent applies
// the configuration, then every override on top of it: an override replaces
// whatever the configuration says about that exact fact, and nothing else.
// An override stays until it is reset (`infermesh policy reset`), even when
// a later configuration agrees with it, so an operator's decision is never
// silently undone by an edit of the file.
//
// Signed revocations (KindSignedRevoke) are kept here too, with the mirror,
// but they are the authority's word, not this node's operator's: the
// newest statement about a subject replaces the one before, a lifting
// included (so an older revocation replayed later is known to be older),
// and Reset never removes one.
//
// # Damage
//
// The store never crashes the agent and never starts it with less policy
// than it had without saying so (integrity.go, mirror.go): a damaged file
// is refused with an error naming it (ErrCorrupt), the policy is mirrored
// in a second file (MirrorFileName) that Open compares with the database
// (ErrMissing, ErrDiverged), and Options.Reset starts over from the mirror,
// keeping the damaged files aside.
package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/infermesh/infermesh/internal/defaults"
)

// FileName is the database file in the state dir.
const FileName = "state.db"

// Kind is what an override is about.
type Kind string

// Override kinds. They are the configuration's names for the same facts.
const (
	// KindAcceptFrom: Node may serve Role to this node (consumer side,
	// roles.<r>.accept_from). `infermesh allow` / `deny`.
	KindAcceptFrom Kind = "accept_from"
	// KindServeTo: this node serves Role to peer Node (serving side,
	// roles.<r>.serve_to). `infermesh serve-to add` / `remove`.
	KindServeTo Kind = "serve_to"
	// KindExpose: Role may leave loopback at all (roles.<r>.expose). Node
	// is empty. `infermesh expose` / `unexpose`.
	KindExpose Kind = "expose"
	// KindRevoke: Node (a node name or a base64 public key) is revoked.
	// Role is empty and On is always true: lifting a run-time revocation
	// deletes the override. `infermesh revoke` / `unrevoke`.
	KindRevoke Kind = "revoke"
	// KindSignedRevoke: the newest statement signed by a cluster
	// authority about Node (a node name or a base64 public key), in
	// Statement (identity.Revocation's text form): On when it revokes,
	// off when it lifts a revocation. Role is empty. Written for every
	// statement the mesh accepts, from anyone; never removed by Reset.
	// `infermesh revoke --authority-key` / `unrevoke --authority-key`.
	KindSignedRevoke Kind = "signed_revoke"
)

// Valid reports whether k is one of the kinds.
func (k Kind) Valid() bool {
	switch k {
	case KindAcceptFrom, KindServeTo, KindExpose, KindRevoke, KindSignedRevoke:
		return true
	}
	return false
}

// Override is one run-time policy fact.
type Override struct {
	Kind Kind      `json:"kind"`
	Role string    `json:"role,omitempty"`
	Node string    `json:"node,omitempty"`
	On   bool      `json:"on"`
	At   time.Time `json:"at"`
	By   string    `json:"by,omitempty"`
	// Statement is a KindSignedRevoke's signed statement (text form);
	// empty for every other kind.
	Statement string `json:"statement,omitempty"`
}

// Key identifies the fact an override is about.
type Key struct {
	Kind Kind
	Role string
	Node string
}

// Key returns o's key.
func (o Override) Key() Key { return Key{o.Kind, o.Role, o.Node} }

func (k Key) bytes() []byte {
	return []byte(string(k.Kind) + "\x00" + k.Role + "\x00" + k.Node)
}

// Validate checks that the key's fields fit its kind.
func (k Key) Validate() error {
	if !k.Kind.Valid() {
		return fmt.Errorf("unknown override kind %q", k.Kind)
	}
	for _, s := range []string{k.Role, k.Node} {
		if strings.ContainsRune(s, 0) {
			return fmt.Errorf("override %s: NUL byte in a name", k.Kind)
		}
	}
	switch k.Kind {
	case KindExpose:
		if k.Role == "" || k.Node != "" {
			return fmt.Errorf("override %s: want a role and no node", k.Kind)
		}
	case KindRevoke, KindSignedRevoke:
		if k.Role != "" || k.Node == "" {
			return fmt.Errorf("override %s: want a node and no role", k.Kind)
		}
	default:
		if k.Role == "" || k.Node == "" {
			return fmt.Errorf("override %s: want a role and a node", k.Kind)
		}
	}
	return nil
}

// Filter selects overrides; empty fields match everything.
type Filter struct {
	Kind Kind
	Role string
	Node string
}

func (f Filter) match(o Override) bool {
	return (f.Kind == "" || f.Kind == o.Kind) && (f.Role == "" || f.Role == o.Role) && (f.Node == "" || f.Node == o.Node)
}

// ErrLocked is returned by Open when another process holds the database.
var ErrLocked = errors.New("state store is in use by another process")

// Options tune Open. Zero values mean the defaults.
type Options struct {
	// LockTimeout bounds the wait for the database's file lock (another
	// agent on the same state dir holds it). Default 1s.
	LockTimeout time.Duration
	// Reset makes Open start over where it would refuse: a damaged
	// database (ErrCorrupt), one that is gone while its policy mirror says
	// it existed (ErrMissing), one that disagrees with its mirror
	// (ErrDiverged), or a damaged mirror. What is damaged is kept aside
	// (<file>.bad-<unix time>), never deleted; the new database holds the
	// mirror's overrides when the mirror verifies, else none (the database's
	// own when only the mirror was damaged). Store.Notes says what was done.
	// The operator asks for it: infermeshd -reset-state.
	Reset bool
}

// Store is the state database. Its methods are safe for concurrent use;
// writes are durable (fsynced) when they return, in the database and in
// the policy mirror (mirror.go).
type Store struct {
	db     *bbolt.DB
	path   string
	mirror string
	notes  []string

	closeOnce sync.Once
	closeErr  error
}

// Open opens (creating it, mode 0600) the database at path and its policy
// mirror beside it. It never crashes on a damaged file: it checks the file
// before bbolt maps it and walks every page, and returns an error naming
// the file (wrapping ErrCorrupt, ErrMissing or ErrDiverged) unless
// opts.Reset. A database held by another process returns an error wrapping
// ErrLocked after Options.LockTimeout.
func Open(path string, opts Options) (*Store, error) {
	defaults.Positive(&opts.LockTimeout, time.Second)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("state store: %w", err)
	}
	s, err := open(path, opts)
	if err == nil || !opts.Reset || errors.Is(err, ErrLocked) {
		return s, err
	}
	return reset(path, opts, err)
}

// open is Open without the reset.
func open(path string, opts Options) (*Store, error) {
	mpath := mirrorPath(path)
	if err := precheck(path, mpath, opts.LockTimeout); err != nil {
		return nil, err
	}
	m, haveMirror, err := readMirror(mpath)
	if err != nil {
		return nil, err
	}
	var db *bbolt.DB
	err = guard(path, func() error {
		var err error
		db, err = bbolt.Open(path, 0o600, &bbolt.Options{Timeout: opts.LockTimeout})
		return err
	})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("state store %s: %w", path, ErrLocked)
		}
		if !errors.Is(err, ErrCorrupt) {
			err = &CorruptError{path, err.Error()}
		}
		return nil, err
	}
	s := &Store{db: db, path: path, mirror: mpath}
	if err := checkDB(path, db); err != nil {
		_ = db.Close()
		return nil, err
	}
	err = guard(path, func() error {
		return db.Update(func(tx *bbolt.Tx) error {
			if err := migrate(tx); err != nil {
				return err
			}
			note, err := s.reconcile(tx, m, haveMirror)
			if note != "" {
				s.notes = append(s.notes, note)
			}
			return err
		})
	})
	if err != nil {
		_ = db.Close()
		if errors.Is(err, ErrDiverged) || errors.Is(err, ErrCorrupt) {
			return nil, err
		}
		return nil, fmt.Errorf("state store %s: %w", path, err)
	}
	return s, nil
}

// precheck takes the database's lock (as bbolt will: another agent holding
// it is ErrLocked, and a file it is writing is not judged) and checks the
// file. A database that is missing or empty is new, unless its mirror is
// there: then it existed and is gone.
func precheck(path, mpath string, timeout time.Duration) error {
	st, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("state store %s: %w", path, err)
	}
	if err != nil || st.Size() == 0 {
		if _, merr := os.Stat(mpath); merr == nil {
			what := "missing"
			if err == nil {
				what = "empty (0 bytes)"
			}
			return fmt.Errorf("%w: %s is %s, but its policy mirror %s says it existed: start with -reset-state to make a new one holding the mirror's overrides",
				ErrMissing, path, what, mpath)
		}
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("state store %s: %w", path, err)
	}
	defer f.Close()
	err = underLock(f, timeout, func() error { return checkFile(path) })
	if errors.Is(err, ErrLocked) {
		return fmt.Errorf("state store %s: %w", path, err)
	}
	return err
}

// reset is Open's answer to a refusal (why) when the operator asked for a
// reset: the damaged file(s) go aside, a new database is made.
func reset(path string, opts Options, why error) (*Store, error) {
	mpath := mirrorPath(path)
	stamp := strconv.FormatInt(time.Now().Unix(), 10)
	var notes []string
	aside := func(p string) error {
		if _, err := os.Stat(p); err != nil {
			return nil
		}
		to := p + ".bad-" + stamp
		if err := os.Rename(p, to); err != nil {
			return fmt.Errorf("reset: %w", err)
		}
		notes = append(notes, fmt.Sprintf("kept %s aside as %s", p, to))
		return nil
	}
	m, _, merr := readMirror(mpath)
	if ce, ok := errors.AsType[*CorruptError](why); ok && ce.Path == mpath {
		// Only the mirror is damaged: the database, once verified, is the
		// policy; the mirror is written again from it.
		if err := aside(mpath); err != nil {
			return nil, err
		}
		s, err := open(path, opts)
		if err != nil {
			return nil, err
		}
		s.notes = append(append([]string{"reset: " + why.Error()}, notes...), s.notes...)
		return s, nil
	}
	if err := aside(path); err != nil {
		return nil, err
	}
	if merr != nil {
		if err := aside(mpath); err != nil {
			return nil, err
		}
		m = mirror{}
	} else if err := aside(mpath); err != nil {
		return nil, err
	}
	s, err := open(path, opts)
	if err != nil {
		return nil, err
	}
	if len(m.Overrides) > 0 || len(m.Clients) > 0 || m.Generation > 0 {
		err = s.db.Update(func(tx *bbolt.Tx) error {
			if err := replaceOverrides(tx, m); err != nil {
				return err
			}
			return writeMirror(s.mirror, m)
		})
		if err != nil {
			_ = s.Close()
			return nil, fmt.Errorf("state store %s: restore the mirror's overrides: %w", path, err)
		}
	}
	restored := fmt.Sprintf("new state store with the policy mirror's %d overrides and %d clients", len(m.Overrides), len(m.Clients))
	if merr != nil {
		restored = "new state store with no run-time overrides: the policy mirror was damaged too (" + merr.Error() + ")"
	}
	s.notes = append(append([]string{"reset: " + why.Error()}, notes...), restored)
	return s, nil
}

// Notes are what Open repaired or reset, for the caller to log and audit.
func (s *Store) Notes() []string { return s.notes }

// MirrorPath is the policy mirror file.
func (s *Store) MirrorPath() string { return s.mirror }

// Path is the database file.
func (s *Store) Path() string { return s.path }

// Close closes the database. It is idempotent.
func (s *Store) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.db.Close() })
	return s.closeErr
}

// Put records o, replacing an override of the same key, and returns the
// previous one (ok false when there was none).
func (s *Store) Put(o Override) (prev Override, ok bool, err error) {
	if err := o.Key().Validate(); err != nil {
		return Override{}, false, err
	}
	if (o.Kind == KindSignedRevoke) != (o.Statement != "") {
		return Override{}, false, fmt.Errorf("override %s: a statement goes with signed_revoke, and only with it", o.Kind)
	}
	if o.At.IsZero() {
		o.At = time.Now()
	}
	o.At = o.At.UTC()
	v, err := json.Marshal(o)
	if err != nil {
		return Override{}, false, err
	}
	k := o.Key().bytes()
	err = s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketOverrides.key())
		if old := b.Get(k); old != nil {
			if err := json.Unmarshal(old, &prev); err != nil {
				return fmt.Errorf("override %q: %w", k, err)
			}
			ok = true
		}
		if err := b.Put(k, v); err != nil {
			return err
		}
		return s.commitMirror(tx)
	})
	if err != nil {
		return Override{}, false, fmt.Errorf("store override: %w", err)
	}
	return prev, ok, nil
}

// Delete removes the override of k and returns it (ok false when there was
// none).
func (s *Store) Delete(k Key) (prev Override, ok bool, err error) {
	if err := k.Validate(); err != nil {
		return Override{}, false, err
	}
	kb := k.bytes()
	err = s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketOverrides.key())
		old := b.Get(kb)
		if old == nil {
			return nil
		}
		if err := json.Unmarshal(old, &prev); err != nil {
			return fmt.Errorf("override %q: %w", kb, err)
		}
		ok = true
		if err := b.Delete(kb); err != nil {
			return err
		}
		return s.commitMirror(tx)
	})
	if err != nil {
		return Override{}, false, fmt.Errorf("delete override: %w", err)
	}
	return prev, ok, nil
}

// Overrides returns every override, sorted by kind, role, node.
func (s *Store) Overrides() ([]Override, error) {
	return s.list(Filter{})
}

func (s *Store) list(f Filter) ([]Override, error) {
	var out []Override
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketOverrides.key()).ForEach(func(k, v []byte) error {
			var o Override
			if err := json.Unmarshal(v, &o); err != nil {
				return fmt.Errorf("override %q: %w", k, err)
			}
			if f.match(o) {
				out = append(out, o)
			}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list overrides: %w", err)
	}
	sortOverrides(out)
	return out, nil
}

// Reset deletes every override f matches, in one transaction, and returns
// them. Signed revocations (KindSignedRevoke) are never deleted.
func (s *Store) Reset(f Filter) ([]Override, error) {
	var gone []Override
	err := s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketOverrides.key())
		var keys [][]byte
		err := b.ForEach(func(k, v []byte) error {
			var o Override
			if err := json.Unmarshal(v, &o); err != nil {
				return fmt.Errorf("override %q: %w", k, err)
			}
			if f.match(o) && o.Kind != KindSignedRevoke {
				keys = append(keys, bytes.Clone(k))
				gone = append(gone, o)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range keys {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		if len(keys) == 0 {
			return nil
		}
		return s.commitMirror(tx)
	})
	if err != nil {
		return nil, fmt.Errorf("reset overrides: %w", err)
	}
	sortOverrides(gone)
	return gone, nil
}

func sortOverrides(os []Override) {
	slices.SortFunc(os, func(a, b Override) int {
		return cmpStrings(string(a.Kind), string(b.Kind), a.Role, b.Role, a.Node, b.Node)
	})
}

func cmpStrings(pairs ...string) int {
	for i := 0; i+1 < len(pairs); i += 2 {
		if c := strings.Compare(pairs[i], pairs[i+1]); c != 0 {
			return c
		}
	}
	return 0
}
