// Package ctxwait waits for a duration unless a context ends first: the one
// cancellable sleep the demo model (token pacing) and provisioning (restart
// and retry backoff) share.
package ctxwait

import (
	"context"
	"time"
)

// Sleep waits for d or until ctx is done, whichever comes first, and
// reports whether d elapsed. A d <= 0 returns at once, true unless ctx is
// already done. The timer is released either way.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
