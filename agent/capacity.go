package agent

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/infermesh/infermesh/proxy"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/enginestat"
	"github.com/infermesh/infermesh/placement"
)

// The local instances' capacity: what each says of its slots, queue and KV
// cache (llama.cpp's and vLLM's metrics, read by package enginestat), or,
// for an instance without metrics, the role's capacity (config) with the
// agent's own in-flight count standing in for the rest. It is put in the
// placement table (SetLocalCapacity), which the mesh advertises within its
// load adverts' byte budget (mesh.Config.AdvertLoadBudget).
//
// An engine that reports no slot count (vLLM's metrics have none) has
// them read off its numbers: when requests wait, the running ones fill
// it. The role's capacity, when set, is its slot count whatever the engine
// says.
//
// An instance is asked at most every capacityEvery, and only while
// requests flow through this agent to it or for capacityQuiet after its
// numbers last changed (so the end of a burst is seen): an idle instance is
// not asked at all. llama.cpp's /slots, which gives the slot count, is
// asked at most every slotsEvery. An instance whose metrics fail is asked
// again after capacityRetry; meanwhile the agent's count stands in.

const (
	capacityEvery   = 250 * time.Millisecond
	capacityQuiet   = 5 * time.Second
	capacityRetry   = 10 * time.Second
	slotsEvery      = 30 * time.Second
	capacityTimeout = time.Second
	maxMetricsBytes = 4 << 20
)

// roleCapacity is what the watch keeps of one role's instance.
type roleCapacity struct {
	base    string
	cap     placement.Capacity
	asked   time.Time // last time anything was decided (scraped or not)
	changed time.Time // last time cap changed
	failed  time.Time // last metrics failure (zero: none since success)
	slots   int       // from /slots, 0 unknown
	// slotsCtx is the context the slots hold together (llama.cpp's KV
	// cache, in tokens), from /slots; 0 unknown.
	slotsCtx uint32
	// inferred is the slot count read off an engine that reports no
	// slots (vLLM): how many ran the last time some waited (0: none
	// waited yet).
	inferred   int
	slotsAt    time.Time
	slotsNever bool // /slots is not served: stop asking
	prefix     prefixRatio
}

// prefixRatio is an instance's prefix cache hit ratio over recent minutes,
// from its counters (vLLM's prefix_cache_queries and _hits, in tokens):
// what each scrape adds, decayed with prefixHalfLife. A counter that went
// down (the engine restarted) starts over.
type prefixRatio struct {
	queries, hits float64 // decayed sums
	lastQ, lastH  float64 // the counters at the last scrape
	at            time.Time
	seen          bool
}

// prefixHalfLife is how fast the hit ratio forgets.
const prefixHalfLife = time.Minute

func (p *prefixRatio) add(queries, hits float64, now time.Time) {
	if p.seen && queries >= p.lastQ && hits >= p.lastH {
		f := math.Exp2(-float64(now.Sub(p.at)) / float64(prefixHalfLife))
		p.queries = p.queries*f + (queries - p.lastQ)
		p.hits = p.hits*f + (hits - p.lastH)
	}
	p.lastQ, p.lastH, p.at, p.seen = queries, hits, now, true
}

// ratio is the hit ratio, false before any query was counted.
func (p *prefixRatio) ratio() (float64, bool) {
	if p.queries <= 0 {
		return 0, false
	}
	return min(p.hits/p.queries, 1), true
}

// watchCapacity keeps the local instances' capacity in the table until ctx
// ends.
func (a *Agent) watchCapacity(ctx context.Context) {
	client := &http.Client{Timeout: capacityTimeout}
	defer client.CloseIdleConnections()
	roles := map[string]*roleCapacity{}
	t := time.NewTicker(capacityEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		locals := a.table.Snapshot().Locals
		for role := range roles {
			if _, ok := locals[role]; !ok {
				delete(roles, role)
				a.metrics.ForgetCapacity(role)
			}
		}
		for role, l := range locals {
			rc := roles[role]
			if rc == nil || rc.base != l.Base {
				rc = &roleCapacity{base: l.Base}
				roles[role] = rc
			}
			a.updateCapacity(ctx, client, role, rc, time.Now())
		}
	}
}

// metricsMode is role's metrics setting: the managed instance's, else the
// role's (a static upstream's); auto by default.
func (a *Agent) metricsMode(role string) (mode string, capacity int) {
	rc := a.config().Roles[role]
	mode = rc.Metrics
	if rc.Instance != nil && rc.Instance.Metrics != "" {
		mode = rc.Instance.Metrics
	}
	if mode == "" {
		mode = enginestat.Auto
	}
	return mode, rc.Capacity
}

func (a *Agent) updateCapacity(ctx context.Context, client *http.Client, role string, rc *roleCapacity, now time.Time) {
	inFlight := max(a.proxy.LocalInFlight(role), 0)
	if !rc.asked.IsZero() && inFlight == 0 && now.Sub(rc.changed) >= capacityQuiet {
		return // idle: nothing to ask
	}
	rc.asked = now
	mode, configured := a.metricsMode(role)
	var c placement.Capacity
	scraped := false
	external := int64(0)
	if mode != enginestat.None && (rc.failed.IsZero() || now.Sub(rc.failed) >= capacityRetry) {
		st, err := a.scrapeMetrics(ctx, client, role, rc.base, mode)
		switch {
		case err != nil:
			if rc.failed.IsZero() {
				a.log.Info("instance metrics not read; the agent's own count stands in", zap.String("role", role), zap.Error(err))
			}
			rc.failed = now
		default:
			rc.failed, scraped = time.Time{}, true
			// What the engine counts beyond this agent's own (the larger
			// of its count before and after the scrape: never load made
			// up).
			external = max(int64(st.Running+st.Waiting)-max(inFlight, a.proxy.LocalInFlight(role)), 0)
			c.Running, c.Waiting = uint32(st.Running), uint32(st.Waiting)
			if st.HasKV {
				c.KVUsage = float32(st.KVUsage)
			}
			c.CacheTokens = uint32(st.CacheTokens)
			if st.Engine == enginestat.LlamaCpp {
				c.CacheTokens = rc.slotsCtx // its context, from /slots
			}
			if st.HasPrefix {
				rc.prefix.add(st.PrefixQueries, st.PrefixHits, now)
				if r, ok := rc.prefix.ratio(); ok {
					c.CacheHit, c.HasCacheHit = placement.RoundCacheHit(r), true
				}
			}
			if st.Waiting > 0 && st.Running > 0 {
				// Requests wait only when every slot runs one (or the
				// KV cache holds no more): that many is its capacity
				// now.
				rc.inferred = int(st.Running)
			}
			if st.Engine == enginestat.LlamaCpp && !rc.slotsNever && now.Sub(rc.slotsAt) >= slotsEvery {
				rc.slotsAt = now
				if n, ctxTokens, err := a.scrapeSlots(ctx, client, role, rc.base); err != nil {
					rc.slotsNever = true // llama-server --no-slots: the config's capacity says
				} else {
					rc.slots, rc.slotsCtx = n, uint32(ctxTokens)
				}
			}
		}
	}
	slots := rc.slots
	if slots == 0 {
		slots = rc.inferred
	}
	if configured > 0 {
		slots = configured
	}
	c.Slots = uint32(slots)
	if !scraped {
		// The agent's count: what it sent and has not had answered.
		c.Running, c.Waiting = uint32(inFlight), 0
		if s := int64(slots); s > 0 && inFlight > s {
			c.Running, c.Waiting = uint32(s), uint32(inFlight-s)
		}
	}
	a.externalOf(role).Store(external)
	if c != rc.cap || rc.changed.IsZero() {
		rc.cap, rc.changed = c, now
		a.table.SetLocalCapacity(role, c)
		a.metrics.SetCapacity(role, c)
	}
}

func (a *Agent) scrapeMetrics(ctx context.Context, client *http.Client, role, base, mode string) (enginestat.Stats, error) {
	b, err := a.getInstance(ctx, client, role, base+"/metrics")
	if err != nil {
		return enginestat.Stats{}, err
	}
	return enginestat.Parse(b, mode)
}

func (a *Agent) scrapeSlots(ctx context.Context, client *http.Client, role, base string) (int, float64, error) {
	b, err := a.getInstance(ctx, client, role, base+"/slots")
	if err != nil {
		return 0, 0, err
	}
	return enginestat.ParseSlots(b)
}

// getInstance GETs url of role's instance, with its API key when it needs
// one.
func (a *Agent) getInstance(ctx context.Context, client *http.Client, role, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	if k := a.upstreamKey(role); k != "" {
		req.Header.Set("Authorization", "Bearer "+k)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxMetricsBytes+1))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	if len(b) > maxMetricsBytes {
		return nil, fmt.Errorf("GET %s: over %d bytes", url, maxMetricsBytes)
	}
	return b, nil
}

func (a *Agent) externalOf(role string) *atomic.Int64 {
	v, ok := a.external.Load(role)
	if !ok {
		v, _ = a.external.LoadOrStore(role, new(atomic.Int64))
	}
	return v.(*atomic.Int64)
}

// cacheHitRatio is role's local instance's prefix cache hit ratio over
// recent minutes, as its capacity carries it (in hundredths, from its
// last scrape); false when its metrics say none (llama.cpp, no metrics,
// nothing looked up yet).
func (a *Agent) cacheHitRatio(role string) (float64, bool) {
	return a.table.LocalCapacity(role).CacheHitRatio()
}

// externalLoad is the requests at role's local instance that did not come
// through this agent, as its engine last counted them (0 without metrics).
func (a *Agent) externalLoad(role string) int64 {
	if v, ok := a.external.Load(role); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

// loadReport is role's load as its answers to peers report it: this
// agent's count now, and the instance's capacity with its running and
// waiting counts brought up to now (what the engine counted beyond this
// agent, plus this agent's count now), so that a consumer never reads a
// request that has ended, its own among them, as still running.
func (a *Agent) loadReport(role string) proxy.LoadReport {
	mine := max(a.proxy.LocalInFlight(role), 0)
	c := a.table.LocalCapacity(role)
	occ := mine + a.externalLoad(role)
	c.Running, c.Waiting = uint32(min(occ, math.MaxUint32)), 0
	if s := int64(c.Slots); s > 0 && occ > s {
		c.Running, c.Waiting = uint32(s), uint32(min(occ-s, math.MaxUint32))
	}
	return proxy.LoadReport{Load: uint32(min(mine, math.MaxUint32)), Capacity: c}
}
