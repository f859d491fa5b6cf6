package routing

import (
	"container/list"
	"sync"
)

// Index is an approximate prefix index: per target (a node, or the local
// instance), the prompt blocks this node has sent it, as chained block
// hashes (a block's hash names the whole prefix up to its end), in an LRU
// of a bounded number of blocks. It predicts what the target's own prefix
// cache holds without asking it, the way the Gateway API inference
// extension's approximate prefix scorer does: it sharpens the prefill
// estimate and is never trusted over a target's own load. The bound
// stands in for the target's cache size; an engine that evicted sooner
// costs one misjudged prefill.
//
// Safe for concurrent use.
type Index struct {
	mu      sync.Mutex
	blocks  int // per target
	targets map[string]*lru
}

type lru struct {
	order *list.List // front: most recent; values are uint64 hashes
	at    map[uint64]*list.Element
}

// NewIndex returns an index holding up to blocks blocks per target.
func NewIndex(blocks int) *Index {
	return &Index{blocks: max(blocks, 1), targets: map[string]*lru{}}
}

// Cached is how many of blocks, from the first, target probably holds:
// the longest run of leading blocks the index has for it.
func (x *Index) Cached(target string, blocks []uint64) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.cachedLocked(target, blocks)
}

func (x *Index) cachedLocked(target string, blocks []uint64) int {
	if len(blocks) == 0 {
		return 0
	}
	l := x.targets[target]
	if l == nil {
		return 0
	}
	// Chained hashes: block k present means its prefix was sent whole.
	// Presence is monotone along a prompt: Record touches a block's
	// prefix with it, the earlier blocks last (the freshest), so the LRU
	// evicts a prompt's later blocks before its earlier ones and block k
	// is never held without block k-1. The longest leading run is then
	// found by binary search: the first block not held.
	lo, hi := 0, len(blocks) // blocks[:lo] held; blocks[hi:] not
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if _, ok := l.at[blocks[m]]; ok {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// FillCached sets each candidate's CachedTokens to Cached of the target at
// the same index of targets, times blockTokens, under one lock.
func (x *Index) FillCached(targets []string, blocks []uint64, blockTokens int, cands []Cand) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, t := range targets[:min(len(targets), len(cands))] {
		cands[i].CachedTokens = x.cachedLocked(t, blocks) * blockTokens
	}
}

// Record notes that blocks were sent to target (the instance will cache
// them), most recent first for eviction. limit, when above 0 and below
// the index's bound, is the target's own cache size in blocks (what it
// advertises): the target's entries are held to it.
func (x *Index) Record(target string, blocks []uint64, limit int) {
	if len(blocks) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	l := x.targets[target]
	if l == nil {
		l = &lru{order: list.New(), at: map[uint64]*list.Element{}}
		x.targets[target] = l
	}
	bound := x.blocks
	if limit > 0 && limit < bound {
		bound = limit
	}
	// Back to front, so the first block ends the most recent: it is
	// shared by the most requests and is the last to go.
	for i := len(blocks) - 1; i >= 0; i-- {
		h := blocks[i]
		if e, ok := l.at[h]; ok {
			l.order.MoveToFront(e)
			continue
		}
		l.at[h] = l.order.PushFront(h)
		for l.order.Len() > bound {
			old := l.order.Back()
			l.order.Remove(old)
			delete(l.at, old.Value.(uint64))
		}
	}
}

// Forget drops what the index holds for target (it restarted, or left).
func (x *Index) Forget(target string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.targets, target)
}

// Len is the blocks held for target.
func (x *Index) Len(target string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	if l := x.targets[target]; l != nil {
		return l.order.Len()
	}
	return 0
}
