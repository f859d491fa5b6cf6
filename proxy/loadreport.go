package proxy

import (
	"math"
	"strconv"
	"strings"

	"github.com/infermesh/infermesh/placement"
)

// Load reports: fresher than gossip, at no extra traffic. Every answer an
// agent sends a peer for a role carries, in LoadHeader, its load for the
// role at that moment (its requests in flight at the instance) and what
// the instance reports of its capacity (placement.Capacity), the way
// Envoy's ORCA reports ride on responses. The consumer takes it
// (Config.OnLoadReport) before relaying the answer; like every Infermesh-*
// header of a peer's answer, it never reaches the app.

// LoadHeader carries a load report: "load=3, slots=4, running=2,
// waiting=1, kv=0.42, cache=16384, hit=0.73" (the keys in any order;
// unknown keys are ignored; cache, the tokens the KV cache holds, and hit,
// the prefix cache hit ratio, only when known).
const LoadHeader = "Infermesh-Load"

// LoadReport is one report.
type LoadReport struct {
	Load     uint32
	Capacity placement.Capacity
}

// String is the header value.
func (r LoadReport) String() string {
	b := make([]byte, 0, 64)
	b = append(b, "load="...)
	b = strconv.AppendUint(b, uint64(r.Load), 10)
	c := r.Capacity
	if c.Known() {
		b = append(b, ", slots="...)
		b = strconv.AppendUint(b, uint64(c.Slots), 10)
		b = append(b, ", running="...)
		b = strconv.AppendUint(b, uint64(c.Running), 10)
		b = append(b, ", waiting="...)
		b = strconv.AppendUint(b, uint64(c.Waiting), 10)
		b = append(b, ", kv="...)
		b = strconv.AppendFloat(b, float64(c.KVUsage), 'f', 3, 32)
		if c.CacheTokens > 0 {
			b = append(b, ", cache="...)
			b = strconv.AppendUint(b, uint64(c.CacheTokens), 10)
		}
		if c.HasCacheHit {
			b = append(b, ", hit="...)
			b = strconv.AppendFloat(b, float64(c.CacheHit), 'f', 2, 32)
		}
	}
	return string(b)
}

// ParseLoadReport reads a LoadHeader value; false when it holds no load.
// A peer's values are bounded: counts to 32 bits, the KV share to 0..1.
func ParseLoadReport(v string) (LoadReport, bool) {
	var r LoadReport
	seen := false
	for field := range strings.SplitSeq(v, ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(field), "=")
		if !ok {
			return LoadReport{}, false
		}
		if k == "kv" || k == "hit" {
			f, err := strconv.ParseFloat(val, 32)
			if err != nil || math.IsNaN(f) {
				return LoadReport{}, false
			}
			if k == "kv" {
				r.Capacity.KVUsage = float32(min(max(f, 0), 1))
			} else {
				r.Capacity.CacheHit, r.Capacity.HasCacheHit = placement.RoundCacheHit(f), true
			}
			continue
		}
		n, err := strconv.ParseUint(val, 10, 32)
		if err != nil {
			if k == "load" || k == "slots" || k == "running" || k == "waiting" || k == "cache" {
				return LoadReport{}, false
			}
			continue
		}
		switch k {
		case "load":
			r.Load, seen = uint32(n), true
		case "slots":
			r.Capacity.Slots = uint32(n)
		case "running":
			r.Capacity.Running = uint32(n)
		case "waiting":
			r.Capacity.Waiting = uint32(n)
		case "cache":
			r.Capacity.CacheTokens = uint32(n)
		}
	}
	if !seen {
		return LoadReport{}, false
	}
	return r, true
}
