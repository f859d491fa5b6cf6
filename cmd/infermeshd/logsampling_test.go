package main

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestAccessLogIsNotSampledByZap: 1000 access-log lines in a burst all
// arrive (the access log samples by its own setting), while 1000 copies of
// one other message are cut to the production sampler's first 100 plus
// every 100th after. The same logger also keeps With fields on both routes.
func TestAccessLogIsNotSampledByZap(t *testing.T) {
	obs, logs := observer.New(zapcore.InfoLevel)
	s := zap.NewProductionConfig().Sampling
	log := zap.New(samplingExceptAccess(*s)(obs)).With(zap.String("node", "a"))

	access := log.Named(accessLoggerName)
	other := log.Named("proxy")
	const n = 1000
	for i := 0; i < n; i++ {
		access.Info("request", zap.Int("i", i))
		other.Info("upstream slow", zap.Int("i", i))
	}
	var got, kept int
	for _, e := range logs.All() {
		if e.ContextMap()["node"] != "a" {
			t.Fatalf("entry %q lost the logger's fields: %v", e.Message, e.ContextMap())
		}
		switch e.LoggerName {
		case accessLoggerName:
			got++
		case "proxy":
			kept++
		}
	}
	if got != n {
		t.Errorf("access log: %d of %d lines written, want all", got, n)
	}
	// Within one second the sampler keeps the first Initial, then every
	// Thereafter-th; a burst that a stalled host spreads over a second
	// boundary keeps another Initial, still far from all of them.
	least := s.Initial + (n-s.Initial)/s.Thereafter
	if kept < least || kept > n/2 {
		t.Errorf("other messages: %d of %d written, want sampled (at least %d, at most %d)", kept, n, least, n/2)
	}
}
