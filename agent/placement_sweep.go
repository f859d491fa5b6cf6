package agent

import (
	"context"
	"math"
	"time"
)

// upkeepInterval is how often the placement table is swept and the local
// load refreshed. The mesh sends a load change within its load adverts'
// byte budget (at most once a second).
const upkeepInterval = 250 * time.Millisecond

// upkeepPlacement keeps the placement table current while the agent runs:
// adverts whose TTL ran out are swept (a generation bump that status, route
// and anyone waiting on the table see), and each exposed local role's load
// is the number of requests its instance is serving now (for local apps
// and peers alike), which the mesh advertises, rate-limited.
func (a *Agent) upkeepPlacement(ctx context.Context) {
	t := time.NewTicker(upkeepInterval)
	defer t.Stop()
	self := a.table.NodeID()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.table.ExpireStale()
		for _, ad := range a.table.Advertisements() {
			if ad.Node != self {
				continue
			}
			role := ad.Role()
			n := a.proxy.LocalInFlight(role)
			a.table.SetLocalLoad(role, uint32(min(max(n, 0), math.MaxUint32)))
		}
	}
}
