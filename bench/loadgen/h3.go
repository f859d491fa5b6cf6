package main

import (
	"context"
	"time"

	"github.com/infermesh/infermesh/mesh/meshbench"
)

// The bare HTTP/3 exchange (meshbench.BareH3) is the floor of the remote
// hop: two mesh transports in the load generator's process, measured in the
// same run as the agents.

// h3LatencyRep runs bare HTTP/3 exchanges of a small chat completion one at
// a time for dur.
func (b *bench) h3LatencyRep(ctx context.Context, h *meshbench.BareH3, dur time.Duration, record bool) error {
	body := smallBody("chat")
	ctx, cancel := context.WithTimeout(ctx, dur+30*time.Second)
	defer cancel()
	lat := make([]time.Duration, 0, 1<<15)
	start := time.Now()
	deadline := start.Add(dur)
	for {
		t0 := time.Now()
		if err := h.Do(ctx, body); err != nil {
			return err
		}
		t1 := time.Now()
		lat = append(lat, t1.Sub(t0))
		if t1.After(deadline) {
			break
		}
	}
	if record {
		b.h3 = append(b.h3, pcts(lat))
	}
	return nil
}
