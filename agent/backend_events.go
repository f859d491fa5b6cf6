package agent

import (
	"context"

	"github.com/infermesh/infermesh/agent/admin"
)

// Events implements admin.Backend.
func (b *Backend) Events(ctx context.Context, fn func(admin.Event) error) error {
	ch, cancel := b.a.audit.Subscribe(256)
	defer cancel()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-ch:
			if !ok {
				return nil
			}
			if err := fn(admin.Event{Time: e.Time.UTC(), Kind: e.Kind, Role: e.Role, Node: e.Node, Fields: e.Fields}); err != nil {
				return err
			}
		}
	}
}
