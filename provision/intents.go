package provision

import (
	"encoding/json"
	"errors"
	"fmt"

	"go.etcd.io/bbolt"
)

// IntentStore persists provision specs (durable intent) keyed by provider
// ref. An intent is written before its resource is created and deleted only
// after the resource is gone, so after a crash every resource has an intent
// (adopt it) or is unwanted (sweep it). Implementations must be safe for
// concurrent use; Put and Delete must be durable when they return.
type IntentStore interface {
	PutIntent(ref string, spec ProvisionSpec) error
	DeleteIntent(ref string) error
	Intents() (map[string]ProvisionSpec, error)
}

// BoltIntents is an IntentStore in one bucket of a bbolt database the caller
// owns (and closes): keys are provider refs, values ProvisionSpec JSON.
// Values written by earlier releases stay readable (ProvisionSpec's
// UnmarshalJSON).
type BoltIntents struct {
	db     *bbolt.DB
	bucket []byte
}

var _ IntentStore = (*BoltIntents)(nil)

// NewBoltIntents returns an IntentStore in bucket of db, creating the bucket.
func NewBoltIntents(db *bbolt.DB, bucket string) (*BoltIntents, error) {
	if db == nil {
		return nil, errors.New("bolt intents: db is nil")
	}
	if bucket == "" {
		return nil, errors.New("bolt intents: bucket is empty")
	}
	b := &BoltIntents{db: db, bucket: []byte(bucket)}
	err := db.Update(func(tx *bbolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(b.bucket)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bolt intents: create bucket %q: %w", bucket, err)
	}
	return b, nil
}

// PutIntent stores spec under ref, replacing any previous intent.
func (b *BoltIntents) PutIntent(ref string, spec ProvisionSpec) error {
	if ref == "" {
		return errors.New("put intent: empty ref")
	}
	v, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("put intent %s: %w", ref, err)
	}
	err = b.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).Put([]byte(ref), v)
	})
	if err != nil {
		return fmt.Errorf("put intent %s: %w", ref, err)
	}
	return nil
}

// DeleteIntent removes the intent for ref; a missing intent is not an error.
func (b *BoltIntents) DeleteIntent(ref string) error {
	err := b.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).Delete([]byte(ref))
	})
	if err != nil {
		return fmt.Errorf("delete intent %s: %w", ref, err)
	}
	return nil
}

// Intents returns every stored intent by ref.
func (b *BoltIntents) Intents() (map[string]ProvisionSpec, error) {
	out := make(map[string]ProvisionSpec)
	err := b.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(b.bucket).ForEach(func(k, v []byte) error {
			var s ProvisionSpec
			if err := json.Unmarshal(v, &s); err != nil {
				return fmt.Errorf("intent %s: %w", k, err)
			}
			out[string(k)] = s
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list intents: %w", err)
	}
	return out, nil
}
