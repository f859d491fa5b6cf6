package main

import (
	"context"
	"testing"
	"time"

	"github.com/infermesh/infermesh/mesh/meshbench"
)

// A repetition of the bare HTTP/3 exchange records its latencies, and
// Close stops every goroutine (TestMain's goleak check).
func TestH3LatencyRep(t *testing.T) {
	h, err := meshbench.NewBareH3()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	b := &bench{}
	if err := b.h3LatencyRep(context.Background(), h, 20*time.Millisecond, true); err != nil {
		t.Fatal(err)
	}
	if got := len(b.h3); got != 1 {
		t.Fatalf("got %d recorded repetitions, want 1", got)
	}
	if r := b.h3[0]; r.N == 0 || r.P50 <= 0 || r.P99 < r.P50 {
		t.Errorf("got %+v, want exchanges with p50 > 0 and p99 >= p50", r)
	}
}
