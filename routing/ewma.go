package routing

import (
	"sync"
	"time"
)

// Stats keeps per target (a node, or the local instance) the recent
// service time and prefill cost per token, as exponentially weighted
// moving averages of what this node observed. Safe for concurrent use.
type Stats struct {
	mu sync.Mutex
	m  map[string]*targetStats
}

type targetStats struct {
	service, perToken float64 // ns; 0: none yet
}

// statsWeight is the weight of a new sample: about the last ten count.
const statsWeight = 0.1

// NewStats returns empty stats.
func NewStats() *Stats { return &Stats{m: map[string]*targetStats{}} }

func ewma(old, sample float64) float64 {
	if old == 0 {
		return sample
	}
	return old + statsWeight*(sample-old)
}

// ObserveService records a request's time at target from dispatch to its
// end, for one that did not wait for a slot.
func (s *Stats) ObserveService(target string, d time.Duration) {
	if d <= 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.get(target)
	t.service = ewma(t.service, float64(d))
}

// ObserveFirstToken records the time to the first token at target (less
// the network) of a request that did not wait for a slot and had
// uncached tokens to prefill.
func (s *Stats) ObserveFirstToken(target string, d time.Duration, uncached int) {
	if d <= 0 || uncached <= 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.get(target)
	t.perToken = ewma(t.perToken, float64(d)/float64(uncached))
}

func (s *Stats) get(target string) *targetStats {
	t := s.m[target]
	if t == nil {
		t = &targetStats{}
		s.m[target] = t
	}
	return t
}

// Fill sets each candidate's Service and PrefillPerToken from the stats of
// the target at the same index of targets (zero when not yet observed),
// under one lock.
func (s *Stats) Fill(targets []string, cands []Cand) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, t := range targets[:min(len(targets), len(cands))] {
		if ts := s.m[t]; ts != nil {
			cands[i].Service, cands[i].PrefillPerToken = time.Duration(ts.service), time.Duration(ts.perToken)
		} else {
			cands[i].Service, cands[i].PrefillPerToken = 0, 0
		}
	}
}

// Of returns target's service time and prefill cost per token; zero when
// not yet observed.
func (s *Stats) Of(target string) (service, perToken time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t := s.m[target]; t != nil {
		return time.Duration(t.service), time.Duration(t.perToken)
	}
	return 0, 0
}
