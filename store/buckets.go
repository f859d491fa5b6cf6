package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"go.etcd.io/bbolt"
)

// The registry of buckets. Every bucket of state.db is declared here, once,
// under one naming rule: <owner>.<name>.v<N>, where owner is the package
// whose records it holds, name what they are, and N the version of their
// encoding (a new encoding is a new bucket, migrated at Open). Open creates
// every registered bucket, so a handle never finds its bucket missing, and
// moves a bucket found under one of its former names (Legacy) to its name
// in the same transaction as the checks of the policy mirror: a state.db
// written by an earlier release opens with everything it held.
//
// A package outside this one reads and writes its records through a
// Bucket, a typed handle on its own bucket: it never sees the database,
// and it cannot reach another package's bucket, or the policy overrides,
// whose every change must go with the mirror.

// BucketID names one registered bucket. Only this package makes them: the
// exported values below are the buckets other packages own.
type BucketID struct {
	owner, name string
	version     int
	// legacy are the bucket's former names, before the naming rule.
	legacy []string
}

// Name is the bucket's name in the database: <owner>.<name>.v<N>.
func (id BucketID) Name() string { return fmt.Sprintf("%s.%s.v%d", id.owner, id.name, id.version) }

// Legacy are the names earlier releases gave the bucket.
func (id BucketID) Legacy() []string { return append([]string(nil), id.legacy...) }

func (id BucketID) key() []byte { return []byte(id.Name()) }

// The buckets, by owner.
var (
	// bucketOverrides holds the policy overrides (Override JSON under
	// Key.bytes), changed only with the mirror (mirror.go).
	bucketOverrides = BucketID{"store", "overrides", 1, []string{"policy_overrides.v1"}}
	// bucketMeta holds the policy generation the mirror is compared by.
	bucketMeta = BucketID{"store", "meta", 1, []string{"store_meta.v1"}}

	// MeshPeers: the peers the mesh rejoins after a restart (package
	// mesh's KnownPeer list, one value).
	MeshPeers = BucketID{"mesh", "peers", 1, []string{"mesh_peers.v1"}}
	// MeshSeqs: the mesh's advert sequence numbers (its own floor, the
	// high-water marks and advert sets of every origin heard; one value).
	MeshSeqs = BucketID{"mesh", "seqs", 1, []string{"mesh_seqs.v1"}}
	// AgentAudit: the agent's audit history, saved whole (one value).
	AgentAudit = BucketID{"agent", "audit", 1, []string{"audit.v1"}}
	// ProvisionIntents: the instance intents (package provision's
	// ProvisionSpec by provider ref).
	ProvisionIntents = BucketID{"provision", "intents", 1, []string{"provision.intents"}}
	// NodeIntents: the node bootstrap records (package provision/node's
	// Record by node name).
	NodeIntents = BucketID{"node", "intents", 1, []string{"node.intents"}}
)

// registry is every bucket Open creates and migrates.
var registry = []BucketID{bucketOverrides, bucketMeta, bucketClients, MeshPeers, MeshSeqs, AgentAudit, ProvisionIntents, NodeIntents}

// Buckets returns every registered bucket.
func Buckets() []BucketID { return append([]BucketID(nil), registry...) }

func registered(id BucketID) bool {
	for _, r := range registry {
		if r.Name() == id.Name() {
			return true
		}
	}
	return false
}

// migrate creates every registered bucket, moving one found under a former
// name. When both names are there, a release that knew only the former
// name ran on the file after this one: its writes are the newest, and they
// replace the bucket.
func migrate(tx *bbolt.Tx) error {
	for _, id := range registry {
		for _, old := range id.legacy {
			from := tx.Bucket([]byte(old))
			if from == nil {
				continue
			}
			if tx.Bucket(id.key()) != nil {
				if err := tx.DeleteBucket(id.key()); err != nil {
					return fmt.Errorf("bucket %s: %w", id.Name(), err)
				}
			}
			to, err := tx.CreateBucket(id.key())
			if err != nil {
				return fmt.Errorf("bucket %s: %w", id.Name(), err)
			}
			if err := copyBucket(to, from); err != nil {
				return fmt.Errorf("move bucket %s to %s: %w", old, id.Name(), err)
			}
			if err := tx.DeleteBucket([]byte(old)); err != nil {
				return fmt.Errorf("move bucket %s to %s: %w", old, id.Name(), err)
			}
		}
		if _, err := tx.CreateBucketIfNotExists(id.key()); err != nil {
			return fmt.Errorf("bucket %s: %w", id.Name(), err)
		}
	}
	return nil
}

// copyBucket copies every key of from into to, nested buckets included.
func copyBucket(to, from *bbolt.Bucket) error {
	return from.ForEach(func(k, v []byte) error {
		if v != nil {
			return to.Put(bytes.Clone(k), bytes.Clone(v))
		}
		sub, err := to.CreateBucketIfNotExists(bytes.Clone(k))
		if err != nil {
			return err
		}
		return copyBucket(sub, from.Bucket(k))
	})
}

// Bucket is a typed handle on one registered bucket: records of T, stored
// as JSON under string keys. Each method runs in a transaction of its own
// that the store runs; writes are durable (fsynced) when they return. Safe
// for concurrent use.
type Bucket[T any] struct {
	s  *Store
	id BucketID
}

// OpenBucket returns the handle on bucket id of s. It fails for a bucket other
// packages may not hold (the policy's, whose changes go with the mirror)
// and for a nil store.
func OpenBucket[T any](s *Store, id BucketID) (*Bucket[T], error) {
	if s == nil {
		return nil, errors.New("state store bucket: no store")
	}
	if !registered(id) || id.owner == "store" {
		return nil, fmt.Errorf("state store bucket %q: not a bucket of the registry other packages may hold", id.Name())
	}
	return &Bucket[T]{s: s, id: id}, nil
}

// ID is the bucket the handle is on.
func (b *Bucket[T]) ID() BucketID { return b.id }

// Get returns the record under key; ok false when there is none.
func (b *Bucket[T]) Get(key string) (v T, ok bool, err error) {
	err = b.s.db.View(func(tx *bbolt.Tx) error {
		raw := tx.Bucket(b.id.key()).Get([]byte(key))
		if raw == nil {
			return nil
		}
		ok = true
		return json.Unmarshal(raw, &v)
	})
	if err != nil {
		var zero T
		return zero, false, fmt.Errorf("%s record %q: %w", b.id.Name(), key, err)
	}
	return v, ok, nil
}

// Put stores v under key, replacing any record there.
func (b *Bucket[T]) Put(key string, v T) error {
	if key == "" {
		return fmt.Errorf("%s: empty key", b.id.Name())
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("%s record %q: %w", b.id.Name(), key, err)
	}
	err = b.s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.id.key()).Put([]byte(key), raw)
	})
	if err != nil {
		return fmt.Errorf("%s record %q: %w", b.id.Name(), key, err)
	}
	return nil
}

// Delete removes the record under key; a missing one is not an error.
func (b *Bucket[T]) Delete(key string) error {
	err := b.s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.id.key()).Delete([]byte(key))
	})
	if err != nil {
		return fmt.Errorf("%s record %q: %w", b.id.Name(), key, err)
	}
	return nil
}

// ForEach calls fn with every record in key order, in one read
// transaction: fn must not use the store. A record that does not decode
// stops the walk with an error naming its key; so does an error of fn,
// which is returned as is.
func (b *Bucket[T]) ForEach(fn func(key string, v T) error) error {
	var fnErr error
	err := b.s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.id.key()).ForEach(func(k, raw []byte) error {
			var v T
			if err := json.Unmarshal(raw, &v); err != nil {
				return fmt.Errorf("%s record %q: %w", b.id.Name(), k, err)
			}
			if err := fn(string(k), v); err != nil {
				fnErr = err
				return err
			}
			return nil
		})
	})
	if fnErr != nil {
		return fnErr
	}
	return err
}

// Len is the number of records.
func (b *Bucket[T]) Len() (n int, err error) {
	err = b.s.db.View(func(tx *bbolt.Tx) error {
		n = tx.Bucket(b.id.key()).Stats().KeyN
		return nil
	})
	return n, err
}
