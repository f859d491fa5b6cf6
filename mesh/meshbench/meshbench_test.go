package meshbench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/mesh"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m, nil) }

// fast is a loopback-tuned profile, like memberlist's DefaultLocalConfig
// except RetransmitMult: at its 2, broadcasts (alive messages and adverts
// alike) die out before reaching everyone and convergence falls back to
// push/pull (measured: 23 s for an advert at N=50 instead of under 1 s).
func fast(c *mesh.Config) {
	c.GossipInterval = 100 * time.Millisecond
	c.ProbeInterval = 200 * time.Millisecond
	c.ProbeTimeout = 100 * time.Millisecond
	c.SuspicionMult = 3
	c.RetransmitMult = 4
	c.TCPTimeout = time.Second
	c.PushPullInterval = 15 * time.Second
}

func TestMeasureSmall(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := Measure(ctx, 3, fast)
	if err != nil {
		t.Fatal(err)
	}
	if r.Advert <= 0 || r.Death <= 0 {
		t.Errorf("Measure = %v, want positive durations", r)
	}
	t.Log(r)
}

// BenchmarkAdvertConvergence reports, per node count, the time for an
// advert to reach every node and for a dead node's role to stop resolving
// everywhere, with the LAN defaults and with the loopback profile.
func BenchmarkAdvertConvergence(b *testing.B) {
	// The loopback profile probes 5 times a second: from N=50 on, 2 shared
	// cores cannot keep up, probes time out and nodes are wrongly declared
	// dead, so it is measured at N=10 only.
	for _, profile := range []struct {
		name string
		tune func(*mesh.Config)
		ns   []int
	}{{"lan", nil, []int{10, 50, 100}}, {"local", fast, []int{10}}} {
		for _, n := range profile.ns {
			b.Run(fmt.Sprintf("%s/N=%d", profile.name, n), func(b *testing.B) {
				var advert, death time.Duration
				for b.Loop() {
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
					r, err := Measure(ctx, n, profile.tune)
					cancel()
					if err != nil {
						// The phases before the failed one, with their
						// times: an advert that "did not arrive" after a
						// slow formation had only what was left of ctx.
						b.Fatalf("%v; so far: %v", err, r)
					}
					b.Log(r)
					advert += r.Advert
					death += r.Death
				}
				b.ReportMetric(float64(advert.Milliseconds())/float64(b.N), "advert-ms")
				b.ReportMetric(float64(death.Milliseconds())/float64(b.N), "death-ms")
			})
		}
	}
}
