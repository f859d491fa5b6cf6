package agent

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP/HTTP traces endpoint: it decodes each export
// with the OTLP protobuf package and keeps the spans, with the
// service.instance.id of the resource they came in.
type otlpReceiver struct {
	url  string
	mu   sync.Mutex
	errs []string
	got  []receivedSpan
}

type receivedSpan struct {
	node string // the resource's service.instance.id
	svc  string // its service.name
	span *tracepb.Span
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	o := &otlpReceiver{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				o.fail("gzip: " + err.Error())
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			body = zr
		}
		b, err := io.ReadAll(body)
		var req coltrace.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(b, &req)
		}
		if r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" || err != nil {
			o.fail(fmt.Sprintf("%s %s (%s): %v", r.Method, r.URL.Path, r.Header.Get("Content-Type"), err))
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		o.mu.Lock()
		for _, rs := range req.GetResourceSpans() {
			attrs := attrMap(rs.GetResource().GetAttributes())
			for _, ss := range rs.GetScopeSpans() {
				for _, sp := range ss.GetSpans() {
					o.got = append(o.got, receivedSpan{node: attrs["service.instance.id"], svc: attrs["service.name"], span: sp})
				}
			}
		}
		o.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	})}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	o.url = "http://" + ln.Addr().String() + "/v1/traces"
	return o
}

func (o *otlpReceiver) fail(msg string) {
	o.mu.Lock()
	o.errs = append(o.errs, msg)
	o.mu.Unlock()
}

// trace returns the spans received of the trace with id (hex).
func (o *otlpReceiver) trace(id string) []receivedSpan {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []receivedSpan
	for _, s := range o.got {
		if hex.EncodeToString(s.span.GetTraceId()) == id {
			out = append(out, s)
		}
	}
	return out
}

func attrMap(kvs []*commonpb.KeyValue) map[string]string {
	m := map[string]string{}
	for _, kv := range kvs {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			m[kv.GetKey()] = v.GetStringValue()
		case v.GetArrayValue() != nil:
			var xs []string
			for _, e := range v.GetArrayValue().GetValues() {
				xs = append(xs, e.GetStringValue())
			}
			m[kv.GetKey()] = strings.Join(xs, ",")
		default:
			m[kv.GetKey()] = fmt.Sprint(v.GetIntValue())
		}
	}
	return m
}

// TestTraceAcrossTheHop: a streamed chat request from an app on a, served
// by b's instance, with the app's own traceparent, makes one trace: a's
// request span (server, the route decision and the GenAI attributes, the
// first token as an event) is the child of the app's span; a's attempt at b
// (client) its child; b's serving span (server) the attempt's child; b's
// upstream call (client) the serving span's child; and the instance saw a
// traceparent of that trace naming b's upstream call. Each node's spans
// name it in their resource. A request without a traceparent starts a
// trace of its own that crosses the hop the same way.
func TestTraceAcrossTheHop(t *testing.T) {
	recv := startOTLPReceiver(t)
	tm := newTestMesh(t, "a", "b")
	tel := fmt.Sprintf("telemetry: {otlp_endpoint: %q}\n", recv.url)
	tm.extraYAML = map[string]string{"a": tel, "b": tel}
	ub := startUpstream(t, "model-b", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })

	const traceID, appSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	send := func(traceparent string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions",
			strings.NewReader(`{"model":"chat","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Content-Type", "application/json")
		if traceparent != "" {
			req.Header.Set("Traceparent", traceparent)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("chat through a = %d", resp.StatusCode)
		}
	}
	send("00-" + traceID + "-" + appSpan + "-01")

	var spans []receivedSpan
	waitFor(t, "the four spans of the trace exported", func() bool {
		spans = recv.trace(traceID)
		return len(spans) >= 4
	})
	find := func(node, name string) *tracepb.Span {
		t.Helper()
		for _, s := range spans {
			if s.node == node && s.span.GetName() == name {
				if s.svc != "infermesh" {
					t.Errorf("%s's span %q: service.name %q", node, name, s.svc)
				}
				return s.span
			}
		}
		var names []string
		for _, s := range spans {
			names = append(names, s.node+":"+s.span.GetName())
		}
		t.Fatalf("no span %q of %s in the trace: %v", name, node, names)
		return nil
	}
	req, att := find("a", "infermesh.proxy chat"), find("a", "infermesh.attempt b")
	serve, up := find("b", "infermesh.serve chat"), find("b", "infermesh.attempt local")
	parent := func(child, of *tracepb.Span, ofID string) {
		t.Helper()
		want := ofID
		if of != nil {
			want = hex.EncodeToString(of.GetSpanId())
		}
		if got := hex.EncodeToString(child.GetParentSpanId()); got != want {
			t.Errorf("span %q's parent is %s, want %s", child.GetName(), got, want)
		}
	}
	parent(req, nil, appSpan)
	parent(att, req, "")
	parent(serve, att, "")
	parent(up, serve, "")
	for s, kind := range map[*tracepb.Span]tracepb.Span_SpanKind{req: tracepb.Span_SPAN_KIND_SERVER, att: tracepb.Span_SPAN_KIND_CLIENT,
		serve: tracepb.Span_SPAN_KIND_SERVER, up: tracepb.Span_SPAN_KIND_CLIENT} {
		if s.GetKind() != kind {
			t.Errorf("span %q is of kind %v, want %v", s.GetName(), s.GetKind(), kind)
		}
	}
	ra := attrMap(req.GetAttributes())
	for k, v := range map[string]string{
		"gen_ai.operation.name": "chat", "gen_ai.request.model": "chat", "infermesh.route.candidates": "b",
		"infermesh.served_by": "b", "infermesh.attempts": "1", "http.response.status_code": "200",
	} {
		if ra[k] != v {
			t.Errorf("a's request span: %s = %q, want %q (all: %v)", k, ra[k], v, ra)
		}
	}
	if ra["gen_ai.usage.output_tokens"] == "" || ra["gen_ai.usage.output_tokens"] == "0" || ra["gen_ai.usage.input_tokens"] == "" {
		t.Errorf("a's request span has no usage: %v", ra)
	}
	if !slices.ContainsFunc(req.GetEvents(), func(e *tracepb.Span_Event) bool { return e.GetName() == "gen_ai.first_token" }) {
		t.Errorf("a's request span has no first-token event: %v", req.GetEvents())
	}
	if m := attrMap(up.GetAttributes())["gen_ai.response.model"]; m != "model-b" {
		t.Errorf("b's upstream call: gen_ai.response.model %q, want model-b", m)
	}
	ub.mu.Lock()
	seen := slices.Clone(ub.parents)
	ub.mu.Unlock()
	want := "00-" + traceID + "-" + hex.EncodeToString(up.GetSpanId()) + "-01"
	if !slices.Contains(seen, want) {
		t.Errorf("the instance saw traceparents %q, want %q (b's upstream call)", seen, want)
	}

	// No traceparent from the app: a starts the trace; it crosses the hop.
	send("")
	waitFor(t, "a trace started by a, with b's spans in it", func() bool {
		ub.mu.Lock()
		last := ub.parents[len(ub.parents)-1]
		ub.mu.Unlock()
		f := strings.Split(last, "-")
		if len(f) != 4 || f[1] == traceID {
			return false
		}
		got := recv.trace(f[1])
		nodes := map[string]bool{}
		for _, s := range got {
			nodes[s.node] = true
			if s.span.GetName() == "infermesh.proxy chat" && len(s.span.GetParentSpanId()) != 0 {
				t.Fatalf("a's request span of a trace it started has a parent")
			}
		}
		return len(got) >= 4 && nodes["a"] && nodes["b"]
	})
	recv.mu.Lock()
	defer recv.mu.Unlock()
	if len(recv.errs) > 0 {
		t.Errorf("the receiver refused exports: %v", recv.errs)
	}
}
