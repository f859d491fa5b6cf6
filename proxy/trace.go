package proxy

import (
	"context"
	"net/http"
)

// Tracing hooks. With Config.Tracer set, every request the proxy takes (an
// app's, or a peer's served here) gets a trace: the Tracer starts its span
// from the request's traceparent (W3C Trace Context), each attempt at a
// candidate gets a span of its own (a failover is another attempt), and
// the traceparent the next hop sees, the peer agent or the instance, names
// the attempt's span. Nil Tracer: tracing is off and the request path asks
// nothing of it (one nil check per request). The agent's telemetry
// package implements it with the OpenTelemetry SDK.

// Tracer starts the trace of a request.
type Tracer interface {
	// Request starts the span of r, arriving for role ("" until known)
	// from source (app or peer), continuing the trace r's headers name.
	// The returned context carries the span.
	Request(r *http.Request, role, source string) (context.Context, RequestTrace)
}

// RequestTrace is one request's trace. Its methods are called from the
// request's goroutine only, in order: Route, then for each candidate tried
// Attempt (and AttemptFailed when it did not serve), Outcome once the
// request is answered, End last.
type RequestTrace interface {
	// Route records the decision: the model asked for and the
	// candidates in the order they will be tried.
	Route(model string, candidates []string)
	// Attempt starts the span of an attempt at target (a peer node, or
	// "local" for this node's instance serving model) and sets in h the
	// trace headers the attempt's request carries, naming its span.
	Attempt(target string, local bool, model string, h http.Header)
	// AttemptFailed ends the current attempt: it did not serve the
	// request (status 0: no answer; err may be nil for a refusal).
	AttemptFailed(status int, err error)
	// Outcome records how the request ended (and ends the attempt that
	// served it).
	Outcome(o Outcome)
	// End ends the request's span. It may come without an Outcome (a
	// request refused before any candidate was considered).
	End()
}

type traceKey struct{}

// requestTrace is r's trace, nil when tracing is off (without looking
// into r's context then).
func (p *Proxy) requestTrace(r *http.Request) RequestTrace {
	if p.cfg.Tracer == nil {
		return nil
	}
	rt, _ := r.Context().Value(traceKey{}).(RequestTrace)
	return rt
}

// startTrace starts r's trace when tracing is on, and returns the request
// carrying it (r itself when off) and the trace (nil when off).
func (p *Proxy) startTrace(r *http.Request, role, source string) (*http.Request, RequestTrace) {
	tr := p.cfg.Tracer
	if tr == nil {
		return r, nil
	}
	ctx, rt := tr.Request(r, role, source)
	return r.WithContext(context.WithValue(ctx, traceKey{}, rt)), rt
}
