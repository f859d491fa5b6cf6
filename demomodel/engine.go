package demomodel

import (
	"container/list"
	"context"
	"sync"
	"time"

	"github.com/infermesh/infermesh/internal/ctxwait"
)

// engine is the engine mode's state: the slots, the FIFO queue of the
// requests waiting for one, the prefix cache and the counters /metrics,
// /slots and Stats report. Safe for concurrent use; only acquire and
// job.prefill block (both until their context ends), and it starts no
// goroutines.
type engine struct {
	block    int
	prefill  time.Duration
	decode   time.Duration
	capacity int // cache capacity in tokens (0: no cache)

	mu       sync.Mutex // never held across a wait or I/O
	slots    []slotState
	idle     int
	waiting  list.List // of *waiter, the oldest first
	cache    prefixCache
	nextTask int
	c        engineCounters
}

// slotState is one slot as /slots shows it: the request it runs (or ran
// last: llama-server keeps a finished slot's task).
type slotState struct {
	busy      bool
	task      int // -1: never used
	prompt    int // prompt tokens
	processed int // prefilled (not from the cache)
	cached    int
	predict   int // tokens it will generate at most
	decoded   int
	stream    bool
}

// waiter is a request waiting for a slot. slot is set (under the engine's
// lock) when one is handed to it, and then ready is closed.
type waiter struct {
	slot  int
	ready chan struct{}
}

// finish reasons, as vLLM labels vllm:request_success_total.
const (
	finishStop = iota
	finishLength
	finishAbort
	numFinish
)

var finishNames = [numFinish]string{"stop", "length", "abort"}

// engineCounters are the engine's totals since New.
type engineCounters struct {
	requests    uint64 // given a slot and started
	prompt      uint64 // prompt tokens of those
	cached      uint64 // of which came from the cache
	prefilled   uint64 // of which were prefilled
	generated   uint64
	prefillTime time.Duration // nominal: prefilled × PrefillPerToken
	decodeTime  time.Duration // nominal: DecodePerToken per token after the first
	finished    [numFinish]uint64
}

func newEngine(cfg Config, decode time.Duration) *engine {
	e := &engine{
		block:    cfg.CacheBlock,
		prefill:  cfg.PrefillPerToken,
		decode:   decode,
		capacity: cfg.CacheTokens / cfg.CacheBlock * cfg.CacheBlock,
		slots:    make([]slotState, cfg.Parallel),
		idle:     cfg.Parallel,
	}
	for i := range e.slots {
		e.slots[i].task = -1
	}
	e.cache.init(cfg.CacheTokens / cfg.CacheBlock)
	return e
}

// acquire waits for a free slot, behind every request already waiting,
// until ctx ends. A request whose context ends while it waits leaves the
// queue at once.
func (e *engine) acquire(ctx context.Context) (int, error) {
	e.mu.Lock()
	if e.waiting.Len() == 0 && e.idle > 0 {
		s := e.takeIdle()
		e.mu.Unlock()
		return s, nil
	}
	w := &waiter{slot: -1, ready: make(chan struct{})}
	el := e.waiting.PushBack(w)
	e.mu.Unlock()
	select {
	case <-w.ready:
		return w.slot, nil
	case <-ctx.Done():
	}
	e.mu.Lock()
	if s := w.slot; s >= 0 { // handed a slot as ctx ended: pass it on
		e.mu.Unlock()
		e.release(s, -1)
		return -1, ctx.Err()
	}
	e.waiting.Remove(el)
	e.mu.Unlock()
	return -1, ctx.Err()
}

// takeIdle marks the lowest idle slot busy and returns it. e.mu is held
// and a slot is idle.
func (e *engine) takeIdle() int {
	for i := range e.slots {
		if !e.slots[i].busy {
			e.slots[i].busy = true
			e.idle--
			return i
		}
	}
	panic("demomodel: engine: no idle slot")
}

// release frees slot s, counting the request it ran as finished for
// reason (-1: it never started), and hands the slot to the oldest waiting
// request, if any.
func (e *engine) release(s, reason int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if reason >= 0 {
		e.c.finished[reason]++
	}
	if front := e.waiting.Front(); front != nil {
		w := e.waiting.Remove(front).(*waiter)
		w.slot = s
		close(w.ready)
		return
	}
	e.slots[s].busy = false
	e.idle++
}

// job is one generation request on a slot.
type job struct {
	e      *engine
	slot   int
	prompt promptTokens
	cached int
	// reason is how it ended, for the counters: finishAbort unless the
	// answer was complete.
	reason int
}

// admit waits for a slot (acquire), then starts the request on it: its
// cached prefix is looked up and the counters take its prompt. The job
// must be finished.
func (e *engine) admit(ctx context.Context, p promptTokens, predict int, stream bool) (*job, error) {
	s, err := e.acquire(ctx)
	if err != nil {
		return nil, err
	}
	j := &job{e: e, slot: s, prompt: p, reason: finishAbort}
	e.mu.Lock()
	defer e.mu.Unlock()
	// The longest run of leading blocks in the cache, less the last token
	// when it covers the whole prompt: that one is computed again for its
	// logits, as vLLM does.
	j.cached = min(e.cache.lookup(p.blocks)*e.block, p.n-1)
	e.nextTask++
	e.slots[s] = slotState{busy: true, task: e.nextTask, prompt: p.n, processed: p.n - j.cached, cached: j.cached, predict: predict, stream: stream}
	e.c.requests++
	e.c.prompt += uint64(p.n)
	e.c.cached += uint64(j.cached)
	e.c.prefilled += uint64(p.n - j.cached)
	e.c.prefillTime += time.Duration(p.n-j.cached) * e.prefill
	return j, nil
}

// prefill sleeps for the prompt's uncached tokens, then puts its blocks in
// the cache (their KV exists from now on). false: ctx ended first.
func (j *job) prefill(ctx context.Context) bool {
	if d := time.Duration(j.prompt.n-j.cached) * j.e.prefill; d > 0 && !ctxwait.Sleep(ctx, d) {
		return false
	}
	j.e.mu.Lock()
	j.e.cache.insert(j.prompt.blocks)
	j.e.mu.Unlock()
	return true
}

// tokens counts n more generated tokens.
func (j *job) tokens(n int) {
	e := j.e
	e.mu.Lock()
	st := &e.slots[j.slot]
	after := n // the tokens after the first cost DecodePerToken each
	if st.decoded == 0 {
		after = max(0, n-1)
	}
	st.decoded += n
	e.c.generated += uint64(n)
	e.c.decodeTime += time.Duration(after) * e.decode
	e.mu.Unlock()
}

// finish frees the job's slot.
func (j *job) finish() { j.e.release(j.slot, j.reason) }

// engineSnapshot is the engine's state at one moment, for /metrics and
// Stats.
type engineSnapshot struct {
	slots, running, waiting int
	cacheTokens, capacity   int
	inUseTokens             int // tokens of the blocks the running requests hold
	evicted                 uint64
	c                       engineCounters
}

func (e *engine) snapshot() engineSnapshot {
	e.mu.Lock()
	defer e.mu.Unlock()
	sn := engineSnapshot{
		slots: len(e.slots), running: len(e.slots) - e.idle, waiting: e.waiting.Len(),
		cacheTokens: e.cache.lru.Len() * e.block, capacity: e.capacity, evicted: e.cache.evicted, c: e.c,
	}
	for _, st := range e.slots {
		if st.busy && st.task >= 0 {
			sn.inUseTokens += (st.prompt + st.decoded + e.block - 1) / e.block * e.block
		}
	}
	return sn
}

// slotsSnapshot copies the slots' states.
func (e *engine) slotsSnapshot() []slotState {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]slotState, len(e.slots))
	copy(out, e.slots)
	return out
}

// resetCache empties the prefix cache (POST /reset_prefix_cache).
func (e *engine) resetCache() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cache.init(e.cache.capBlocks)
}

// prefixCache is an LRU of block hashes holding at most capBlocks blocks:
// LRU by tokens, every entry being one block of CacheBlock tokens. A
// prompt's blocks are touched from its last to its first, so the first is
// the most recent and a prefix is evicted from its end, as vLLM frees a
// request's blocks in reverse order: what is left of it stays usable.
// Not safe for concurrent use (the engine's lock guards it).
type prefixCache struct {
	capBlocks int
	lru       list.List // of uint64, the most recent first
	idx       map[uint64]*list.Element
	evicted   uint64
}

func (c *prefixCache) init(capBlocks int) {
	c.capBlocks = capBlocks
	c.lru.Init()
	c.idx = make(map[uint64]*list.Element, capBlocks)
}

// lookup returns how many of blocks, from the first, are in the cache.
// They are marked used when the prefill is done (insert).
func (c *prefixCache) lookup(blocks []uint64) int {
	n := 0
	for n < len(blocks) && c.idx[blocks[n]] != nil {
		n++
	}
	return n
}

// insert puts blocks in the cache (marking those it has used) and evicts
// the least recently used beyond its capacity.
func (c *prefixCache) insert(blocks []uint64) {
	if c.capBlocks == 0 {
		return
	}
	for i := len(blocks) - 1; i >= 0; i-- {
		if el := c.idx[blocks[i]]; el != nil {
			c.lru.MoveToFront(el)
		} else {
			c.idx[blocks[i]] = c.lru.PushFront(blocks[i])
		}
	}
	for c.lru.Len() > c.capBlocks {
		el := c.lru.Back()
		delete(c.idx, c.lru.Remove(el).(uint64))
		c.evicted++
	}
}
