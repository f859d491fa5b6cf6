package provision

import (
	"errors"
	"fmt"

	"github.com/infermesh/infermesh/store"
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

// BoltIntents is an IntentStore in the state store's bucket of instance
// intents (store.ProvisionIntents): keys are provider refs, values
// ProvisionSpec JSON. Values written by earlier releases stay readable
// (ProvisionSpec's UnmarshalJSON). The caller owns the store (and closes
// it).
type BoltIntents struct {
	b *store.Bucket[ProvisionSpec]
}

var _ IntentStore = (*BoltIntents)(nil)

// NewBoltIntents returns the IntentStore in st.
func NewBoltIntents(st *store.Store) (*BoltIntents, error) {
	b, err := store.OpenBucket[ProvisionSpec](st, store.ProvisionIntents)
	if err != nil {
		return nil, fmt.Errorf("instance intents: %w", err)
	}
	return &BoltIntents{b: b}, nil
}

// PutIntent stores spec under ref, replacing any previous intent.
func (b *BoltIntents) PutIntent(ref string, spec ProvisionSpec) error {
	if ref == "" {
		return errors.New("put intent: empty ref")
	}
	if err := b.b.Put(ref, spec); err != nil {
		return fmt.Errorf("put intent %s: %w", ref, err)
	}
	return nil
}

// DeleteIntent removes the intent for ref; a missing intent is not an error.
func (b *BoltIntents) DeleteIntent(ref string) error {
	if err := b.b.Delete(ref); err != nil {
		return fmt.Errorf("delete intent %s: %w", ref, err)
	}
	return nil
}

// Intents returns every stored intent by ref.
func (b *BoltIntents) Intents() (map[string]ProvisionSpec, error) {
	out := make(map[string]ProvisionSpec)
	err := b.b.ForEach(func(ref string, s ProvisionSpec) error {
		out[ref] = s
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list intents: %w", err)
	}
	return out, nil
}
