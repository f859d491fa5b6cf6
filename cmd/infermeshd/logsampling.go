package main

import (
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// accessLoggerName is the logger the proxy's access log writes through
// (agent: log.Named("access")).
const accessLoggerName = "access"

// samplingExceptAccess samples every entry as s says (zap's production
// config: per message and level, the first 100 of a second, then every
// 100th, so a flood of one warning cannot fill the disk) except the access
// log's.
// The access log has its own, documented sampling (proxy.access_log_sample,
// errors and aborted streams always kept); zap's sampler on top of it would
// keep 100 of its "request" lines a second and then 1 in 100, errors
// included, and say nothing.
func samplingExceptAccess(s zap.SamplingConfig) func(zapcore.Core) zapcore.Core {
	return func(core zapcore.Core) zapcore.Core {
		return &accessRoute{
			sampled: zapcore.NewSamplerWithOptions(core, time.Second, s.Initial, s.Thereafter),
			all:     core,
		}
	}
}

// accessRoute sends the access log's entries to all and the rest to
// sampled. Both wrap the same core, so fields added by With reach either.
type accessRoute struct {
	sampled zapcore.Core
	all     zapcore.Core
}

func (r *accessRoute) Enabled(l zapcore.Level) bool { return r.all.Enabled(l) }

func (r *accessRoute) With(fields []zapcore.Field) zapcore.Core {
	return &accessRoute{sampled: r.sampled.With(fields), all: r.all.With(fields)}
}

func (r *accessRoute) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if e.LoggerName == accessLoggerName {
		return r.all.Check(e, ce)
	}
	return r.sampled.Check(e, ce)
}

// Write is reached only by a caller that skipped Check; it is not sampled.
func (r *accessRoute) Write(e zapcore.Entry, fields []zapcore.Field) error {
	return r.all.Write(e, fields)
}

func (r *accessRoute) Sync() error { return r.all.Sync() }
