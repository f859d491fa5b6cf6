package node

import (
	"fmt"

	"github.com/infermesh/infermesh/store"
)

// BoltIntents is an IntentStore in the state store's bucket of node
// bootstrap records (store.NodeIntents), keyed by node name. The caller
// owns the store (the agent's).
type BoltIntents struct {
	b *store.Bucket[Record]
}

var _ IntentStore = (*BoltIntents)(nil)

// NewBoltIntents returns the IntentStore in st.
func NewBoltIntents(st *store.Store) (*BoltIntents, error) {
	b, err := store.OpenBucket[Record](st, store.NodeIntents)
	if err != nil {
		return nil, fmt.Errorf("node intents: %w", err)
	}
	return &BoltIntents{b: b}, nil
}

// Put stores rec under its node name (durably: the store syncs each
// update).
func (b *BoltIntents) Put(rec Record) error {
	if err := b.b.Put(rec.Spec.Name, rec); err != nil {
		return fmt.Errorf("node intent %s: %w", rec.Spec.Name, err)
	}
	return nil
}

// Delete removes name's record; a missing one is not an error.
func (b *BoltIntents) Delete(name string) error {
	return b.b.Delete(name)
}

// List returns every record, sorted by node name (the bucket's key order).
func (b *BoltIntents) List() ([]Record, error) {
	var out []Record
	err := b.b.ForEach(func(_ string, r Record) error {
		out = append(out, r)
		return nil
	})
	return out, err
}
