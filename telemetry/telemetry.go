// Package telemetry traces the agent's requests with the OpenTelemetry
// SDK and exports the spans over OTLP/HTTP (telemetry.otlp_endpoint; off
// by default). It implements the proxy's Tracer: a request's span
// continues the W3C traceparent the app sent (or starts a trace), each
// attempt at a candidate is a client span of its own, and the next hop, a
// peer agent or the instance, gets a traceparent naming that attempt, so
// one trace shows every host a request crossed.
//
// Spans (each node's carry service.name infermesh and service.instance.id
// the node's name):
//   - "infermesh.proxy ROLE" (server): an app's request, with the route
//     decision (the candidates in order, the one that served, the
//     attempts);
//   - "infermesh.serve ROLE" (server): a peer's request served here;
//   - "infermesh.attempt TARGET" (client): one attempt, at the local
//     instance (the upstream call) or a peer; a failover is another one.
//
// Attributes follow OpenTelemetry's GenAI semantic conventions where they
// apply: gen_ai.operation.name, gen_ai.request.model,
// gen_ai.response.model, gen_ai.usage.input_tokens and
// gen_ai.usage.output_tokens; the time to the first token is the event
// gen_ai.first_token on the request's span.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/infermesh/infermesh/proxy"
)

// Config configures tracing.
type Config struct {
	// Endpoint is the OTLP/HTTP traces URL, e.g.
	// http://127.0.0.1:4318/v1/traces (a URL without a path gets
	// /v1/traces). Required.
	Endpoint string
	// Sample is the fraction of new traces recorded, 0 to 1; a request
	// whose traceparent says sampled is recorded whatever it is (parent
	// based). Zero means 1.
	Sample float64
	// Node and Version name this agent in the spans' resource.
	Node, Version string
	// BatchTimeout bounds how long a span waits before it is exported.
	// Default 5s.
	BatchTimeout time.Duration
}

// Tracing is a running tracer: the proxy's Tracer. Shutdown flushes it.
type Tracing struct {
	tp    *sdktrace.TracerProvider
	tr    trace.Tracer
	prop  propagation.TextMapPropagator
	node  string
	attrs []attribute.KeyValue // on every span: the node
}

var _ proxy.Tracer = (*Tracing)(nil)

// New starts tracing to cfg.Endpoint. Nothing is sent until a span ends.
func New(cfg Config) (*Tracing, error) {
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("telemetry.otlp_endpoint %q: not an http(s) URL", cfg.Endpoint)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	if cfg.Sample < 0 || cfg.Sample > 1 {
		return nil, fmt.Errorf("telemetry.sample %v: not within 0 and 1", cfg.Sample)
	}
	if cfg.Sample == 0 {
		cfg.Sample = 1
	}
	if cfg.BatchTimeout <= 0 {
		cfg.BatchTimeout = 5 * time.Second
	}
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u.String()))
	if err != nil {
		return nil, fmt.Errorf("telemetry: %w", err)
	}
	res := resource.NewSchemaless(
		semconv.ServiceName("infermesh"),
		semconv.ServiceInstanceID(cfg.Node),
		semconv.ServiceVersion(cfg.Version),
	)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(cfg.BatchTimeout)),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.Sample))),
	)
	return &Tracing{
		tp:    tp,
		tr:    tp.Tracer("github.com/infermesh/infermesh/telemetry"),
		prop:  propagation.TraceContext{},
		node:  cfg.Node,
		attrs: []attribute.KeyValue{attribute.String("infermesh.node", cfg.Node)},
	}, nil
}

// Shutdown exports what is left and stops, within ctx.
func (t *Tracing) Shutdown(ctx context.Context) error { return t.tp.Shutdown(ctx) }

// ForceFlush exports the ended spans now.
func (t *Tracing) ForceFlush(ctx context.Context) error { return t.tp.ForceFlush(ctx) }

// Request implements proxy.Tracer.
func (t *Tracing) Request(r *http.Request, role, source string) (context.Context, proxy.RequestTrace) {
	ctx := t.prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	name := "infermesh.proxy"
	if source == "peer" {
		name = "infermesh.serve"
	}
	if role != "" {
		name += " " + role
	}
	attrs := append([]attribute.KeyValue{
		attribute.String("infermesh.source", source),
		attribute.String("http.request.method", r.Method),
		attribute.String("url.path", r.URL.Path),
		attribute.String("gen_ai.operation.name", operation(r.URL.Path)),
	}, t.attrs...)
	if role != "" {
		attrs = append(attrs, attribute.String("infermesh.role", role))
	}
	ctx, span := t.tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...))
	return ctx, &requestTrace{t: t, ctx: ctx, span: span, start: time.Now(), name: name, named: role != ""}
}

// operation is the GenAI operation a path asks for.
func operation(path string) string {
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return "chat"
	case strings.HasSuffix(path, "/completions"):
		return "text_completion"
	case strings.HasSuffix(path, "/embeddings"):
		return "embeddings"
	}
	return "other"
}

type requestTrace struct {
	t       *Tracing
	ctx     context.Context
	span    trace.Span
	start   time.Time
	name    string
	named   bool       // the span's name has the role
	attempt trace.Span // the current attempt, nil between attempts
	model   string     // the model of the current attempt's instance
	ended   bool
}

func (rt *requestTrace) Route(model string, cands []string) {
	rt.span.SetAttributes(
		attribute.String("gen_ai.request.model", model),
		attribute.StringSlice("infermesh.route.candidates", cands),
	)
}

func (rt *requestTrace) Attempt(target string, local bool, model string, h http.Header) {
	rt.endAttempt(0, nil, false)
	kind := "remote"
	if local {
		kind = "local"
	}
	ctx, span := rt.t.tr.Start(rt.ctx, "infermesh.attempt "+target, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(append([]attribute.KeyValue{
			attribute.String("infermesh.target", target),
			attribute.String("infermesh.target.kind", kind),
		}, rt.t.attrs...)...))
	if model != "" {
		span.SetAttributes(attribute.String("gen_ai.response.model", model))
	}
	rt.attempt, rt.model = span, model
	// The next hop continues from this attempt: whatever traceparent the
	// app sent is replaced (it is this trace's parent, already).
	delete(h, "Traceparent")
	delete(h, "Tracestate")
	rt.t.prop.Inject(ctx, propagation.HeaderCarrier(h))
}

func (rt *requestTrace) AttemptFailed(status int, err error) { rt.endAttempt(status, err, true) }

// endAttempt ends the current attempt, if any; failed marks it an error.
func (rt *requestTrace) endAttempt(status int, err error, failed bool) {
	s := rt.attempt
	if s == nil {
		return
	}
	rt.attempt = nil
	if status != 0 {
		s.SetAttributes(attribute.Int("http.response.status_code", status))
	}
	switch {
	case err != nil:
		s.RecordError(err)
		s.SetStatus(codes.Error, err.Error())
	case failed:
		s.SetStatus(codes.Error, fmt.Sprintf("answered %d: failed over", status))
	}
	s.End()
}

func (rt *requestTrace) Outcome(o proxy.Outcome) {
	attrs := []attribute.KeyValue{
		attribute.Int("http.response.status_code", o.Status),
		attribute.String("infermesh.served_by", o.Target),
		attribute.Int("infermesh.attempts", o.Attempts),
		attribute.String("infermesh.request_id", o.RequestID),
	}
	if !rt.named && o.Role != "" {
		rt.span.SetName(rt.name + " " + o.Role)
		attrs = append(attrs, attribute.String("infermesh.role", o.Role))
	}
	if rt.model != "" {
		attrs = append(attrs, attribute.String("gen_ai.response.model", rt.model))
	}
	if o.Usage {
		attrs = append(attrs,
			attribute.Int64("gen_ai.usage.input_tokens", o.PromptTokens),
			attribute.Int64("gen_ai.usage.output_tokens", o.CompletionTokens))
	}
	if o.Aborted {
		attrs = append(attrs, attribute.Bool("infermesh.aborted", true))
	}
	rt.span.SetAttributes(attrs...)
	if o.FirstEvent > 0 {
		rt.span.AddEvent("gen_ai.first_token", trace.WithTimestamp(rt.start.Add(o.FirstEvent)),
			trace.WithAttributes(attribute.Float64("infermesh.ttft_seconds", o.FirstEvent.Seconds())))
	}
	if o.Status >= 500 || o.Aborted {
		rt.span.SetStatus(codes.Error, http.StatusText(o.Status))
	}
	rt.endAttempt(o.Status, nil, o.Status >= 500 || o.Aborted)
}

func (rt *requestTrace) End() {
	if rt.ended {
		return
	}
	rt.ended = true
	rt.endAttempt(0, errors.New("the request ended before the attempt's answer"), true)
	rt.span.End()
}
