package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"go.etcd.io/bbolt"
)

// BoltIntents is an IntentStore in one bucket of a bbolt database the
// caller owns (the agent's state store).
type BoltIntents struct {
	db     *bbolt.DB
	bucket []byte
}

var _ IntentStore = (*BoltIntents)(nil)

// NewBoltIntents returns the store in bucket of db, creating the bucket.
func NewBoltIntents(db *bbolt.DB, bucket string) (*BoltIntents, error) {
	if db == nil || bucket == "" {
		return nil, errors.New("node intents: no database or bucket")
	}
	b := &BoltIntents{db: db, bucket: []byte(bucket)}
	if err := db.Update(func(tx *bbolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(b.bucket)
		return err
	}); err != nil {
		return nil, fmt.Errorf("node intents: create bucket %q: %w", bucket, err)
	}
	return b, nil
}

// Put stores rec under its node name (durably: bbolt syncs each update).
func (b *BoltIntents) Put(rec Record) error {
	v, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("node intent %s: %w", rec.Spec.Name, err)
	}
	return b.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).Put([]byte(rec.Spec.Name), v)
	})
}

// Delete removes name's record; a missing one is not an error.
func (b *BoltIntents) Delete(name string) error {
	return b.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).Delete([]byte(name))
	})
}

// List returns every record, sorted by node name.
func (b *BoltIntents) List() ([]Record, error) {
	var out []Record
	err := b.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).ForEach(func(k, v []byte) error {
			var r Record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("node intent %s: %w", k, err)
			}
			out = append(out, r)
			return nil
		})
	})
	slices.SortFunc(out, func(a, b Record) int { return strings.Compare(a.Spec.Name, b.Spec.Name) })
	return out, err
}
