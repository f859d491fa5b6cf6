package agent

import (
	"context"

	"github.com/infermesh/infermesh/agent/admin"
)

// Events implements admin.Backend.
func (b *Backend) Events(ctx context.Context, o admin.EventsOptions, fn func(admin.Event) error) error {
	if !o.Follow {
		for _, e := range lastN(b.a.audit.Recent(), o.Last) {
			if err := fn(adminEvent(e)); err != nil {
				return err
			}
		}
		return nil
	}
	ch, cancel := b.a.audit.SubscribeLast(256, o.Last)
	defer cancel()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-ch:
			if !ok {
				return nil
			}
			if err := fn(adminEvent(e)); err != nil {
				return err
			}
		}
	}
}

// adminEvent is e as the admin API sends it: its time in UTC.
func adminEvent(e Event) admin.Event {
	e.Time = e.Time.UTC()
	return e
}

// lastN returns the last n of es (all of them when n < 1).
func lastN(es []Event, n int) []Event {
	if n > 0 && n < len(es) {
		return es[len(es)-n:]
	}
	return es
}
