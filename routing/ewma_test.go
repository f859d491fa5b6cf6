package routing_test

import (
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

func TestStatsService(t *testing.T) {
	s := routing.NewStats()
	if svc, per := s.Of("b"); svc != 0 || per != 0 {
		t.Fatalf("unobserved: %v %v", svc, per)
	}
	for _, tt := range []struct {
		sample, want time.Duration
	}{
		{1000 * ms, 1000 * ms}, // the first, as is
		{0, 1000 * ms},         // ignored
		{-5 * ms, 1000 * ms},   // ignored
		{2000 * ms, 1100 * ms}, // 1000 + 0.1*(2000-1000)
		{100 * ms, 1000 * ms},  // 1100 + 0.1*(100-1100)
		{1000 * ms, 1000 * ms},
	} {
		s.ObserveService("b", tt.sample)
		if got, _ := s.Of("b"); got != tt.want {
			t.Fatalf("after %v: %v, want %v", tt.sample, got, tt.want)
		}
	}
	if _, per := s.Of("b"); per != 0 {
		t.Fatalf("service observed into the cost per token: %v", per)
	}
	// Many samples converge on a steady value.
	for range 200 {
		s.ObserveService("c", 300*ms)
		s.ObserveService("d", 700*ms)
	}
	for range 200 {
		s.ObserveService("c", 500*ms)
	}
	if got, _ := s.Of("c"); got < 499*ms || got > 501*ms {
		t.Fatalf("c converged to %v, want about 500ms", got)
	}
	if got, _ := s.Of("d"); got != 700*ms {
		t.Fatalf("d %v: samples of c leaked", got)
	}
}

func TestStatsFirstToken(t *testing.T) {
	s := routing.NewStats()
	for _, tt := range []struct {
		d        time.Duration
		uncached int
		want     time.Duration
	}{
		{100 * ms, 1000, 100 * time.Microsecond}, // the first, as is
		{0, 1000, 100 * time.Microsecond},        // ignored
		{-1, 1000, 100 * time.Microsecond},       // ignored
		{100 * ms, 0, 100 * time.Microsecond},    // nothing prefilled: ignored
		{100 * ms, -3, 100 * time.Microsecond},   // ignored
		{400 * ms, 2000, 110 * time.Microsecond}, // 100 + 0.1*(200-100)
	} {
		s.ObserveFirstToken("b", tt.d, tt.uncached)
		if _, got := s.Of("b"); got != tt.want {
			t.Fatalf("after %v/%d: %v, want %v", tt.d, tt.uncached, got, tt.want)
		}
	}
	if svc, _ := s.Of("b"); svc != 0 {
		t.Fatalf("cost per token observed into the service time: %v", svc)
	}
	s.ObserveFirstToken("c", 30*ms, 1000)
	if _, got := s.Of("c"); got != 30*time.Microsecond {
		t.Fatalf("c: %v", got)
	}
	if _, got := s.Of("b"); got != 110*time.Microsecond {
		t.Fatalf("b after c: %v", got)
	}
}

func TestStatsConcurrent(t *testing.T) {
	s := routing.NewStats()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			target := []string{"b", "c"}[g%2]
			for i := range 1000 {
				s.ObserveService(target, time.Duration(100+i)*ms)
				s.ObserveFirstToken(target, time.Duration(10+i)*ms, 100)
				s.Of(target)
			}
		})
	}
	wg.Wait()
	if svc, per := s.Of("b"); svc < 100*ms || per <= 0 {
		t.Fatalf("b: %v %v", svc, per)
	}
}
