package meshsim

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/mesh"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRunSmall: a small mesh over the in-memory network forms, hears the
// advert everywhere, and its traffic is counted (adverts a part of all).
func TestRunSmall(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Run(ctx, Options{N: 8, Latency: time.Millisecond, Window: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Log(r)
	if r.Membership <= 0 || r.Advert <= 0 {
		t.Errorf("Run = %v, want positive durations", r)
	}
	if r.BytesPerNodeSec <= 0 || r.AdvertBytesPerNodeSec > r.BytesPerNodeSec {
		t.Errorf("bytes/node/s = %v (adverts %v), want > 0 and adverts a part", r.BytesPerNodeSec, r.AdvertBytesPerNodeSec)
	}
}

// TestRunLoadChanging: with the origin's load changing every second, the
// changes are advertised within the budget (mesh.Config.AdvertLoadBudget:
// the advert bytes beyond a quiet run's at most twice it), and at the end
// every other node holds a load from a change, none stale by more than the
// budget's interval between two load adverts plus a second to spread (at
// N=8: 4 x ceil(log10(9)) = 4 sends of an advert of about 300 bytes over
// 400 B/s: 3 s).
func TestRunLoadChanging(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	quiet, err := Run(ctx, Options{N: 8, Latency: time.Millisecond, Window: 8 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	r, err := Run(ctx, Options{N: 8, Latency: time.Millisecond, Window: 8 * time.Second, LoadEvery: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("quiet: %v\nload changing: %v", quiet, r)
	if r.LoadChanges < 6 {
		t.Errorf("%d load changes over an 8 s window at one a second", r.LoadChanges)
	}
	if r.LoadMissing != 0 || r.LoadStale > 5*time.Second {
		t.Errorf("%d nodes hold no load from a change; the stalest is %v behind, want at most 5 s", r.LoadMissing, r.LoadStale)
	}
	budget := float64(mesh.DefaultAdvertLoadBudget)
	if extra := r.AdvertBytesPerNodeSec - quiet.AdvertBytesPerNodeSec; extra <= 0 || extra > 2*budget {
		t.Errorf("advert bytes/node/s %.0f with the load changing, %.0f without: want more, by at most twice the budget of %.0f", r.AdvertBytesPerNodeSec, quiet.AdvertBytesPerNodeSec, budget)
	}
}

// BenchmarkSim reports formation, advert propagation, traffic and memory
// per node at growing N over the in-memory network (LAN profile, 1 ms
// latency), time dilated by TimeScaleFor(N).
//
// MESHSIM_SETTLE (a duration, simulated) waits that long after the advert
// before measuring traffic (Options.Settle).
func BenchmarkSim(b *testing.B) {
	settle, _ := time.ParseDuration(os.Getenv("MESHSIM_SETTLE"))
	for _, n := range []int{100, 300, 1000} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			for b.Loop() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
				r, err := Run(ctx, Options{N: n, Latency: time.Millisecond, TimeScale: TimeScaleFor(n), Settle: settle})
				cancel()
				if err != nil {
					b.Fatal(err)
				}
				b.Log(r)
				b.ReportMetric(r.Membership.Seconds(), "membership-s")
				b.ReportMetric(r.Advert.Seconds(), "advert-s")
			}
		})
	}
}
