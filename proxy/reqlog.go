package proxy

import (
	crand "crypto/rand"
	"encoding/hex"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Request identity and the access log: every request on a role port or
// from a peer carries an X-Request-Id (the client's, or one made here) on
// both hops and in the response, the response names the node that
// answered it (ServedByHeader), and the access log has one line per
// request.

const (
	// RequestIDHeader carries a request's id: the client's when it sent a
	// usable one, else one this node makes. It is forwarded to the
	// instance and to the peer, so one id names the request on every hop.
	RequestIDHeader = "X-Request-Id"
	// ServedByHeader names the node that answered: the node whose
	// instance served the request, or the node that refused it.
	ServedByHeader = "Infermesh-Served-By"
)

// idPrefix makes this process's request ids unique across nodes and
// restarts; a counter makes them unique within it without a random read
// per request.
var (
	idPrefix  = newIDPrefix()
	idCounter atomic.Uint64
)

func newIDPrefix() string {
	var b [8]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:]) + "-"
}

func newRequestID() string {
	return idPrefix + strconv.FormatUint(idCounter.Add(1), 16)
}

// usableRequestID reports whether a client's id can be passed on as is:
// 1 to 128 characters of letters, digits and . _ : - (a UUID, a trace id).
func usableRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == ':', c == '-':
		default:
			return false
		}
	}
	return true
}

// Request sources, in the access log.
const (
	sourceApp  = "app"  // an app on this host, on a role port
	sourcePeer = "peer" // a peer agent, over the mesh
)

// reqWriter is the ResponseWriter the handlers see: it records what the
// access log reports. Unwrap keeps http.ResponseController (Flush)
// reaching the server's own writer.
type reqWriter struct {
	http.ResponseWriter
	status int
	ttfb   time.Duration
	bytes  int64
	start  time.Time
	model  []byte // the JSON literal the client asked for; set by the handler
	role   string
	route  *RouteInfo // how its candidate was chosen; set by forward
	// client sent the request, according to clientNode ("": this host);
	// set by the handler.
	client, clientNode string
}

func (w *reqWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
		w.ttfb = time.Since(w.start)
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *reqWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

func (w *reqWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// modelName is the model asked for, "" when the handler did not get as
// far as reading it (a refusal).
func (w *reqWriter) modelName() string {
	if len(w.model) < 2 {
		return ""
	}
	return decodeModel(w.model)
}

// noteRequest tells the access log what the handler learnt of the request:
// its role (a peer names it in a header) and the model asked for.
func noteRequest(w http.ResponseWriter, role string, model []byte) {
	if rw, ok := w.(*reqWriter); ok {
		rw.role, rw.model = role, model
	}
}

// noteRoute tells the access log how the request's candidate was chosen.
func noteRoute(w http.ResponseWriter, route *RouteInfo) {
	if rw, ok := w.(*reqWriter); ok {
		rw.route = route
	}
}

// routeFields are the access log's fields of a routed request: the reason,
// and the estimate and the expected cached prefix of the candidate that
// answered (target: "local" or a peer).
func routeFields(ri *RouteInfo, target string) []zap.Field {
	f := []zap.Field{zap.String("route", ri.Reason), zap.String("affinity_key", ri.Key)}
	for _, c := range ri.Candidates {
		if c.Target == target && c.Estimated {
			f = append(f, zap.Duration("estimate", c.Estimate), zap.Int("expected_cached_tokens", c.Cached))
			break
		}
	}
	if ri.Queued > 0 {
		f = append(f, zap.Duration("queued", ri.Queued))
	}
	return f
}

// servedByTarget is a served-by node as a route's target: "local" for
// this node.
func servedByTarget(servedBy, node string) string {
	if servedBy == node {
		return "local"
	}
	return servedBy
}

// traced gives every request an id and the served-by header and logs it
// when it ends (also when the handler aborts the response).
func (p *Proxy) traced(role, source string, h http.Handler) http.Handler {
	node := p.cfg.NodeName
	servedBy := []string{node} // shared by every response: never modified
	alog := p.cfg.AccessLog
	skip := p.cfg.AccessLogSkip
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The keys are canonical constants: no Get/Set, which
		// canonicalize every key they are given.
		id := headerValue(r.Header, RequestIDHeader)
		if !usableRequestID(id) {
			id = newRequestID()
			r.Header[RequestIDHeader] = []string{id}
		}
		if p.cfg.Tracer != nil {
			var rt RequestTrace
			r, rt = p.startTrace(r, role, source)
			defer rt.End()
		}
		wh := w.Header()
		wh[RequestIDHeader] = []string{id}
		if node != "" {
			wh[ServedByHeader] = servedBy
		}
		if alog == nil || !alog.Core().Enabled(zapcore.InfoLevel) {
			// No line would be written (the log's level is above info):
			// nothing to record either.
			h.ServeHTTP(w, r)
			return
		}
		rw := &reqWriter{ResponseWriter: w, start: time.Now(), role: role}
		if source == sourcePeer {
			rw.role = headerValue(r.Header, RoleHeader) // until the handler validated it
		}
		finished := false
		defer func() {
			// Runs also while a panic (an aborted stream) unwinds.
			status := rw.status
			if !finished && status == 0 {
				status = 499
			}
			if finished && status < 400 && skip > 0 && rand.Float64() < skip {
				return
			}
			ce := alog.Check(zapcore.InfoLevel, "request")
			if ce == nil {
				return
			}
			servedBy := headerValue(w.Header(), ServedByHeader)
			fields := []zap.Field{
				zap.String("id", id), zap.String("source", source), zap.String("role", rw.role),
				zap.String("model", rw.modelName()), zap.String("served_by", servedBy),
				zap.String("method", r.Method), zap.String("path", r.URL.Path), zap.Int("status", status),
				zap.Duration("duration", time.Since(rw.start)), zap.Duration("ttfb", rw.ttfb),
				zap.Int64("bytes", rw.bytes), zap.Bool("aborted", !finished)}
			if rw.client != "" {
				fields = append(fields, zap.String("client", rw.client))
				if rw.clientNode != "" {
					fields = append(fields, zap.String("client_node", rw.clientNode))
				}
			}
			if rw.route != nil {
				fields = append(fields, routeFields(rw.route, servedByTarget(servedBy, node))...)
			}
			ce.Write(fields...)
		}()
		h.ServeHTTP(rw, r)
		finished = true
	})
}
