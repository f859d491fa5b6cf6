package routing_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/routing"
)

// chain is n chained block hashes of a prompt: its own blocks, named by
// prompt and position, after the shared ones.
func chain(shared []uint64, prompt, n int) []uint64 {
	out := append([]uint64(nil), shared...)
	for k := len(shared); k < n; k++ {
		out = append(out, uint64(prompt+1)<<32|uint64(k))
	}
	return out
}

// Under eviction a prompt's held blocks stay a leading run (Record
// touches the earlier blocks last), so Cached's binary search finds what a
// scan from the first block finds: many prompts over shared prefixes of
// several lengths, through an index far smaller than they are.
func TestIndexCachedUnderEviction(t *testing.T) {
	x := routing.NewIndex(64)
	r := rand.New(rand.NewPCG(3, 4))
	var sent [][]uint64
	for p := range 2000 {
		shared := chain(nil, 1_000_000+r.IntN(5), r.IntN(12))
		blocks := chain(shared, p, len(shared)+1+r.IntN(30))
		x.Record("b", blocks, 0)
		sent = append(sent, blocks)
		for _, q := range []int{p, r.IntN(p + 1), r.IntN(p + 1)} {
			got, scan := x.Cached("b", sent[q]), 0
			for scan < len(sent[q]) && x.Has("b", sent[q][scan]) {
				scan++
			}
			if got != scan {
				t.Fatalf("prompt %d after %d: Cached %d, a scan finds %d", q, p, got, scan)
			}
		}
	}
}

func TestIndexCached(t *testing.T) {
	x := routing.NewIndex(1024)
	x.Record("b", []uint64{1, 2, 3, 4}, 0)
	for _, tt := range []struct {
		name   string
		target string
		blocks []uint64
		want   int
	}{
		{"the same blocks", "b", []uint64{1, 2, 3, 4}, 4},
		{"a longer prompt: the recorded prefix", "b", []uint64{1, 2, 3, 4, 5, 6}, 4},
		{"a shorter prompt", "b", []uint64{1, 2}, 2},
		{"a different suffix: the shared prefix", "b", []uint64{1, 2, 7, 8}, 2},
		{"a different second block: the first only", "b", []uint64{1, 9, 10, 11}, 1},
		{"first block absent", "b", []uint64{9, 10, 11, 12}, 0},
		{"no blocks", "b", nil, 0},
		{"another target", "c", []uint64{1, 2, 3, 4}, 0},
	} {
		if got := x.Cached(tt.target, tt.blocks); got != tt.want {
			t.Errorf("%s: Cached(%s, %v) = %d, want %d", tt.name, tt.target, tt.blocks, got, tt.want)
		}
	}
	x.Record("b", nil, 0)
	if n := x.Len("b"); n != 4 {
		t.Errorf("Len after recording nothing: %d", n)
	}
	// Record then Cached of the same blocks is their length.
	r := rand.New(rand.NewPCG(9, 9))
	for p := range 50 {
		blocks := chain([]uint64{1, 2}, p, 2+r.IntN(40))
		x.Record("c", blocks, 0)
		if got := x.Cached("c", blocks); got != len(blocks) {
			t.Fatalf("prompt %d: Cached %d after Record of %d", p, got, len(blocks))
		}
		// A different continuation shares what the two have in common.
		other := chain([]uint64{1, 2}, 1000+p, len(blocks)+3)
		if got := x.Cached("c", other); got != 2 {
			t.Fatalf("prompt %d: other continuation Cached %d, want 2", p, got)
		}
	}
}

func TestIndexLRU(t *testing.T) {
	x := routing.NewIndex(8)
	a := []uint64{11, 12, 13, 14}
	b := []uint64{21, 22, 23, 24}
	x.Record("t", a, 0)
	x.Record("t", b, 0)
	if x.Len("t") != 8 || x.Cached("t", a) != 4 || x.Cached("t", b) != 4 {
		t.Fatalf("full index: len %d, a %d, b %d", x.Len("t"), x.Cached("t", a), x.Cached("t", b))
	}
	// Two new blocks evict the two least recent: a's last ones (a's
	// first block was recorded after its last).
	x.Record("t", []uint64{31, 32}, 0)
	if x.Len("t") != 8 || x.Cached("t", a) != 2 || x.Cached("t", b) != 4 {
		t.Fatalf("after eviction: len %d, a %d (want 2), b %d (want 4)", x.Len("t"), x.Cached("t", a), x.Cached("t", b))
	}
	// Recording b again makes it the most recent: the next eviction
	// takes what is left of a.
	x.Record("t", b, 0)
	x.Record("t", []uint64{41, 42}, 0)
	if x.Cached("t", a) != 0 || x.Cached("t", b) != 4 || x.Cached("t", []uint64{31, 32}) != 2 {
		t.Fatalf("after refresh: a %d (want 0), b %d (want 4), c %d (want 2)", x.Cached("t", a), x.Cached("t", b), x.Cached("t", []uint64{31, 32}))
	}
	// A prompt longer than the bound keeps its first blocks.
	long := chain(nil, 7, 20)
	x.Record("t", long, 0)
	if x.Len("t") != 8 || x.Cached("t", long) != 8 {
		t.Fatalf("long prompt: len %d, cached %d (want 8, 8)", x.Len("t"), x.Cached("t", long))
	}
	// A bound below one is one.
	y := routing.NewIndex(0)
	y.Record("t", []uint64{1, 2, 3}, 0)
	if y.Len("t") != 1 || y.Cached("t", []uint64{1, 2, 3}) != 1 {
		t.Fatalf("bound 0: len %d, cached %d", y.Len("t"), y.Cached("t", []uint64{1, 2, 3}))
	}
}

// Many prompts under a hot system prompt: the index stays bounded and
// the hot prefix's first blocks are never evicted.
func TestIndexHotPrefix(t *testing.T) {
	const bound = 64
	x := routing.NewIndex(bound)
	hot := []uint64{101, 102, 103, 104, 105}
	r := rand.New(rand.NewPCG(10, 11))
	for p := range 2000 {
		x.Record("t", chain(hot, p, len(hot)+r.IntN(30)), 0)
		if n := x.Len("t"); n > bound {
			t.Fatalf("prompt %d: %d blocks held, bound %d", p, n, bound)
		}
		if got := x.Cached("t", chain(hot, -1, 40)); got != len(hot) {
			t.Fatalf("prompt %d: hot prefix cached %d, want %d", p, got, len(hot))
		}
	}
	if x.Len("t") != bound {
		t.Fatalf("len %d, want the bound %d", x.Len("t"), bound)
	}
	// The bound is per target.
	x.Record("u", chain(nil, 1, 10), 0)
	if x.Len("u") != 10 || x.Len("t") != bound {
		t.Fatalf("per target: u %d, t %d", x.Len("u"), x.Len("t"))
	}
}

func TestIndexForget(t *testing.T) {
	x := routing.NewIndex(16)
	x.Record("b", []uint64{1, 2, 3}, 0)
	x.Record("c", []uint64{1, 2, 3}, 0)
	x.Forget("b")
	x.Forget("nobody")
	if x.Len("b") != 0 || x.Cached("b", []uint64{1, 2, 3}) != 0 {
		t.Fatalf("forgotten b: len %d", x.Len("b"))
	}
	if x.Len("c") != 3 || x.Cached("c", []uint64{1, 2, 3}) != 3 {
		t.Fatalf("c lost with b: len %d", x.Len("c"))
	}
	x.Record("b", []uint64{1}, 0)
	if x.Cached("b", []uint64{1, 2, 3}) != 1 {
		t.Fatal("b after coming back")
	}
}

func TestIndexConcurrent(t *testing.T) {
	const bound = 128
	x := routing.NewIndex(bound)
	hot := []uint64{1, 2, 3}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 12))
			target := fmt.Sprintf("t%d", g%3)
			for i := range 2000 {
				blocks := chain(hot, g*10000+i%50, len(hot)+r.IntN(20))
				switch i % 4 {
				case 0, 1:
					x.Record(target, blocks, 0)
				case 2:
					if n := x.Cached(target, blocks); n > len(blocks) {
						t.Errorf("cached %d of %d", n, len(blocks))
					}
				case 3:
					if n := x.Len(target); n > bound {
						t.Errorf("len %d past %d", n, bound)
					}
					if i%400 == 3 {
						x.Forget(target)
					}
				}
			}
		})
	}
	wg.Wait()
}

// A target's own cache size (limit) holds its entries below the index's
// bound: it evicts as the target would; other targets keep the bound.
func TestIndexHeldToTheTargetsCache(t *testing.T) {
	x := routing.NewIndex(100)
	x.Record("small", []uint64{1, 2, 3, 4}, 3)
	if n := x.Len("small"); n != 3 {
		t.Errorf("a target of 3 blocks holds %d", n)
	}
	if got := x.Cached("small", []uint64{1, 2, 3, 4}); got != 3 {
		t.Errorf("cached %d, want the first 3 (the last block went first)", got)
	}
	x.Record("big", []uint64{1, 2, 3, 4}, 1000)
	if n := x.Len("big"); n != 4 {
		t.Errorf("a limit over the bound: %d held, want 4", n)
	}
	x.Record("small", []uint64{5}, 3)
	if got := x.Cached("small", []uint64{1, 2, 3}); got != 2 {
		t.Errorf("after one more block: cached %d of the first prefix, want 2", got)
	}
}

// FillCached and Stats.Fill give each candidate what Cached and Of give
// its target, under one lock.
func TestFillMatchesOneByOne(t *testing.T) {
	x := routing.NewIndex(100)
	x.Record("b", []uint64{1, 2, 3}, 0)
	x.Record("c", []uint64{1}, 0)
	st := routing.NewStats()
	st.ObserveService("c", 300*time.Millisecond)
	st.ObserveFirstToken("c", 20*time.Millisecond, 200)
	targets := []string{"a", "b", "c"}
	cands := []routing.Cand{{Service: time.Hour}, {}, {}}
	x.FillCached(targets, []uint64{1, 2, 3, 4}, 64, cands)
	st.Fill(targets, cands)
	for i, target := range targets {
		svc, per := st.Of(target)
		if want := x.Cached(target, []uint64{1, 2, 3, 4}) * 64; cands[i].CachedTokens != want || cands[i].Service != svc || cands[i].PrefillPerToken != per {
			t.Errorf("%s: %+v, want %d cached, service %v, %v a token", target, cands[i], want, svc, per)
		}
	}
	if cands[2].CachedTokens != 64 || cands[2].Service != 300*time.Millisecond {
		t.Errorf("c: %+v", cands[2])
	}
}
