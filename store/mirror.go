package store

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"go.etcd.io/bbolt"
)

// The policy mirror: every override is also written, in the same change,
// to a second file beside the database (MirrorFileName), JSON with a
// checksum of its content. A damaged database therefore never loses a
// revocation in silence: Open compares the two and refuses to start when
// they disagree, and a reset (Options.Reset) restores the overrides from
// the mirror. Both carry a generation, raised by every change, so the one
// window where they may honestly differ (the mirror was written, the
// database's commit did not happen before a crash) is told apart from
// damage: the mirror is then one generation ahead, and it wins (the change
// was the operator's, only its acknowledgement was lost).

// MirrorFileName is the policy mirror in the state dir.
const MirrorFileName = "policy-mirror.json"

var keyGeneration = []byte("policy_generation")

// ErrMissing: the state store existed (its mirror is there) and is gone or
// empty.
var ErrMissing = errors.New("state store is missing")

// ErrDiverged: the database and the policy mirror disagree beyond the crash
// window: one of them lost changes.
var ErrDiverged = errors.New("state store and its policy mirror disagree")

type mirror struct {
	Generation uint64     `json:"generation"`
	Overrides  []Override `json:"overrides"`
	// Clients are the proxy's clients (clients.go); absent when there
	// are none, so a mirror written before clients existed still sums.
	Clients []Client `json:"clients,omitempty"`
}

type mirrorFile struct {
	mirror
	SHA256 string `json:"sha256"` // of the JSON of mirror
}

func mirrorPath(dbPath string) string {
	return filepath.Join(filepath.Dir(dbPath), MirrorFileName)
}

func (m mirror) sum() (string, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return "", err
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:]), nil
}

// readMirror reads and verifies the mirror at path; ok false when there is
// no file.
func readMirror(path string) (m mirror, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return mirror{}, false, nil
	}
	if err != nil {
		return mirror{}, false, fmt.Errorf("policy mirror %s: %w", path, err)
	}
	var f mirrorFile
	if err := json.Unmarshal(b, &f); err != nil {
		return mirror{}, true, &CorruptError{path, "not a policy mirror: " + err.Error()}
	}
	sum, err := f.mirror.sum()
	if err != nil {
		return mirror{}, true, err
	}
	if sum != f.SHA256 {
		return mirror{}, true, &CorruptError{path, "checksum mismatch"}
	}
	for _, o := range f.Overrides {
		if err := o.Key().Validate(); err != nil {
			return mirror{}, true, &CorruptError{path, err.Error()}
		}
	}
	for _, c := range f.Clients {
		if err := c.validate(); err != nil {
			return mirror{}, true, &CorruptError{path, err.Error()}
		}
	}
	sortOverrides(f.Overrides)
	sortClients(f.Clients)
	return f.mirror, true, nil
}

// writeMirror replaces the mirror at path, durably (temp file, fsync,
// rename, fsync of the dir).
func writeMirror(path string, m mirror) error {
	if m.Overrides == nil {
		m.Overrides = []Override{}
	}
	sortOverrides(m.Overrides)
	sortClients(m.Clients)
	sum, err := m.sum()
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(mirrorFile{m, sum}, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("policy mirror: %w", err)
	}
	_, err = f.Write(append(b, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("policy mirror: %w", err)
	}
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

func txGeneration(tx *bbolt.Tx) uint64 {
	b := tx.Bucket(bucketMeta.key())
	if b == nil {
		return 0
	}
	g, _ := strconv.ParseUint(string(b.Get(keyGeneration)), 10, 64)
	return g
}

func txOverrides(tx *bbolt.Tx) ([]Override, error) {
	var out []Override
	err := tx.Bucket(bucketOverrides.key()).ForEach(func(k, v []byte) error {
		var o Override
		if err := json.Unmarshal(v, &o); err != nil {
			return fmt.Errorf("override %q: %w", k, err)
		}
		out = append(out, o)
		return nil
	})
	sortOverrides(out)
	return out, err
}

// commitMirror is the end of every change's transaction: the generation is
// raised and the mirror written with the transaction's overrides before
// bbolt commits. A mirror that cannot be written fails the change.
func (s *Store) commitMirror(tx *bbolt.Tx) error {
	gen := txGeneration(tx) + 1
	b, err := tx.CreateBucketIfNotExists(bucketMeta.key())
	if err != nil {
		return err
	}
	if err := b.Put(keyGeneration, []byte(strconv.FormatUint(gen, 10))); err != nil {
		return err
	}
	cur, err := txOverrides(tx)
	if err != nil {
		return err
	}
	cs, err := txClients(tx)
	if err != nil {
		return err
	}
	return writeMirror(s.mirror, mirror{Generation: gen, Overrides: cur, Clients: cs})
}

// reconcile compares the database with its mirror at Open (in the
// transaction that may repair it) and returns what it did, for the log.
func (s *Store) reconcile(tx *bbolt.Tx, m mirror, haveMirror bool) (note string, err error) {
	gen := txGeneration(tx)
	cur, err := txOverrides(tx)
	if err != nil {
		return "", &CorruptError{s.path, err.Error()}
	}
	cs, err := txClients(tx)
	if err != nil {
		return "", &CorruptError{s.path, err.Error()}
	}
	switch {
	case !haveMirror:
		// A store from before the mirror, or a mirror removed by hand: the
		// database is all there is; mirror it.
		if err := writeMirror(s.mirror, mirror{Generation: gen, Overrides: cur, Clients: cs}); err != nil {
			return "", err
		}
		if len(cur) > 0 {
			return fmt.Sprintf("policy mirror %s written from the state store (%d overrides)", s.mirror, len(cur)), nil
		}
		return "", nil
	case m.Generation == gen && sameOverrides(m.Overrides, cur) && sameClients(m.Clients, cs):
		return "", nil
	case m.Generation == gen+1:
		// The crash window: the mirror has the change the database did not
		// commit. Apply it.
		if err := replaceOverrides(tx, m); err != nil {
			return "", err
		}
		return fmt.Sprintf("state store %s was one change behind its policy mirror (a stop during a change); the mirror's overrides applied", s.path), nil
	default:
		return "", fmt.Errorf("%w: %s is at generation %d with %d overrides and %d clients, %s at generation %d with %d and %d: start with -reset-state to restore the mirror's overrides (the database is kept aside)",
			ErrDiverged, s.path, gen, len(cur), len(cs), s.mirror, m.Generation, len(m.Overrides), len(m.Clients))
	}
}

func sameOverrides(a, b []Override) bool {
	ja, err1 := json.Marshal(normalized(a))
	jb, err2 := json.Marshal(normalized(b))
	return err1 == nil && err2 == nil && string(ja) == string(jb)
}

// normalized is os in UTC, as stored.
func normalized(os []Override) []Override {
	out := make([]Override, len(os))
	for i, o := range os {
		o.At = o.At.UTC()
		out[i] = o
	}
	return out
}

// replaceOverrides makes the database's overrides, clients and generation
// m's.
func replaceOverrides(tx *bbolt.Tx, m mirror) error {
	if err := replaceClients(tx, m.Clients); err != nil {
		return err
	}
	if err := tx.DeleteBucket(bucketOverrides.key()); err != nil {
		return err
	}
	b, err := tx.CreateBucket(bucketOverrides.key())
	if err != nil {
		return err
	}
	for _, o := range m.Overrides {
		v, err := json.Marshal(o)
		if err != nil {
			return err
		}
		if err := b.Put(o.Key().bytes(), v); err != nil {
			return err
		}
	}
	mb, err := tx.CreateBucketIfNotExists(bucketMeta.key())
	if err != nil {
		return err
	}
	return mb.Put(keyGeneration, []byte(strconv.FormatUint(m.Generation, 10)))
}
