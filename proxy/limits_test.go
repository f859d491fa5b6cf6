package proxy

import (
	"math"
	"syscall"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/infermesh/infermesh/placement"
)

// TestMaxConnsAboveFDBudgetWarns: an explicit MaxConns the open-file limit
// cannot hold (two descriptors a connection, after the reserve) is
// warned about once at New, naming both numbers; the default, and a cap
// within the budget, are not.
func TestMaxConnsAboveFDBudgetWarns(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	budget := (int64(rl.Cur) - fdReserve) / 2
	if budget < 2 || budget >= math.MaxInt32 {
		t.Fatalf("open-file limit %d: no budget to test against", rl.Cur)
	}
	table, err := placement.New(placement.Config{NodeID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name     string
		maxConns int
		warn     bool
	}{
		{"default", 0, false},
		{"within the budget", int(budget), false},
		{"above the budget", int(budget) + 1, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			if _, err := New(Config{Resolver: table, MaxConns: tt.maxConns, Logger: zap.New(core)}); err != nil {
				t.Fatal(err)
			}
			entries := logs.FilterMessageSnippet("proxy.max_conns").All()
			if !tt.warn {
				if len(entries) != 0 {
					t.Errorf("warned: %v", entries)
				}
				return
			}
			if len(entries) != 1 {
				t.Fatalf("%d warnings, want 1: %v", len(entries), logs.All())
			}
			f := entries[0].ContextMap()
			if f["max_conns"] != int64(tt.maxConns) || f["budget"] != budget || f["nofile_limit"] != rl.Cur {
				t.Errorf("warning fields %v, want max_conns %d, budget %d, nofile_limit %d", f, tt.maxConns, budget, rl.Cur)
			}
		})
	}
}
