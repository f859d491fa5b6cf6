package routing_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

// benchCands is n candidates as the proxy gathers them: the local
// instance, busy, then peers with and without known slots, at various
// round trips, some with the prompt partly cached, a few refused, cooled
// or failing.
func benchCands(n int) []routing.Cand {
	cands := make([]routing.Cand, n)
	cands[0] = routing.Cand{Local: true, Node: "node-00", Slots: 8, Running: 7, Waiting: 2, InFlight: 9,
		Service: 1800 * ms, PrefillPerToken: 60 * time.Microsecond, CachedTokens: 512}
	for i := 1; i < n; i++ {
		c := routing.Cand{Node: fmt.Sprintf("node-%02d", i), RTT: time.Duration(1+i%7) * ms,
			InFlight: uint32(i % 5)}
		if i%3 != 0 {
			c.Slots, c.Running, c.Waiting = 4, uint32(i%4), uint32(i%2)
		}
		if i%2 == 0 {
			c.Service, c.PrefillPerToken = time.Duration(900+40*i)*ms, time.Duration(40+i)*time.Microsecond
		}
		if i%4 == 1 {
			c.CachedTokens = 256 * (i % 5)
		}
		c.Refused = i%11 == 5
		c.Cooled = i%13 == 7
		c.Fails = i % 17 / 15
		cands[i] = c
	}
	return cands
}

func BenchmarkDecide(b *testing.B) {
	for _, n := range []int{3, 64} {
		b.Run(fmt.Sprintf("cands=%d", n), func(b *testing.B) {
			cands := benchCands(n)
			order, ests := make([]int, 0, n), make([]routing.Estimate, 0, n)
			p := routing.DefaultParams()
			b.ReportAllocs()
			i := uint64(0)
			for b.Loop() {
				i++
				req := routing.Request{Tokens: 1500 + int(i%512), Key: 0x9e3779b97f4a7c15 * i}
				d := routing.Decide(routing.PolicyAuto, cands, req, p, order, ests)
				order, ests = d.Order, d.Estimates
			}
		})
	}
}

func BenchmarkIndexCached(b *testing.B) {
	x := routing.NewIndex(4096)
	const target = "chat/node-07"
	// 4096 blocks held: 128 prompts of 32 blocks.
	blocks := make([]uint64, 33)
	for p := range 128 {
		for k := range 32 {
			blocks[k] = uint64(p)<<32 | uint64(k)
		}
		x.Record(target, blocks[:32], 0)
	}
	// The prompt: one held a while ago, one new block at its end.
	for k := range 32 {
		blocks[k] = uint64(100)<<32 | uint64(k)
	}
	blocks[32] = 1 << 63
	if n := x.Len(target); n != 4096 {
		b.Fatalf("index holds %d", n)
	}
	if n := x.Cached(target, blocks); n != 32 {
		b.Fatalf("cached %d, want 32", n)
	}
	b.ReportAllocs()
	for b.Loop() {
		x.Cached(target, blocks)
	}
}
