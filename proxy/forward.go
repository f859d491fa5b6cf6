package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/clients"
	"github.com/infermesh/infermesh/internal/jsonskip"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/routing"
)

// attemptError says why one candidate could not serve a request before any
// byte of its response reached the client, so the next may be tried.
type attemptError struct {
	target string
	api    *APIError
}

// forward tries the candidates in order. A candidate that fails before its
// response starts is skipped; once a response has started there is no retry,
// and a failure aborts the client's response.
//
// forward owns buf, the request body: it releases it once a response is
// chosen, so a long stream does not hold it. asked must not point into it.
//
// tk is the client an app's request was admitted as (the zero Ticket for a
// peer's): its priority orders the role's queue, its name crosses the hop,
// and the request's end is charged to it (done).
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, role, source string, buf *bodyBuf, asked []byte, cands []placement.Candidate, tk clients.Ticket) {
	body := buf.b
	released := false
	release := func() {
		if !released {
			released = true
			buf.release()
		}
	}
	defer release()
	start := time.Now()
	base := Outcome{Role: role, Source: source, ticket: tk, bodyLen: len(body)}
	outcome := func(o Outcome) Outcome {
		o.Role, o.Source, o.ticket, o.bodyLen = base.Role, base.Source, base.ticket, base.bodyLen
		return o
	}
	var last *attemptError
	tried := 0 // candidates sent the request
	var rr *routeReq
	if source == sourceApp && len(cands) > 1 {
		var apiErr *APIError
		cands, rr, apiErr = p.route(r, role, body, cands, tk.Priority())
		if cands == nil {
			if apiErr == nil { // the client went away while queued
				p.done(r, outcome(Outcome{Status: 499, Aborted: true}), start)
				return
			}
			WriteError(w, apiErr)
			p.done(r, outcome(Outcome{Status: apiErr.Status}), start)
			return
		}
		defer rr.release(p.router)
		noteRoute(w, &rr.info)
	}
	if rr != nil || source == sourcePeer {
		// A slot may free when this ends: the head of the role's queue
		// looks again.
		defer p.kick(role)
	}
	var route *RouteInfo
	if rr != nil {
		route = &rr.info
	}
	rt := p.requestTrace(r)
	if rt != nil {
		names := make([]string, len(cands))
		for i, c := range cands {
			names[i] = c.Node
		}
		rt.Route(decodeModel(asked), names)
	}
	for i, c := range cands {
		more := i < len(cands)-1
		var resp *http.Response
		var err error
		target := "local"
		t0 := time.Now()
		switch c.Kind {
		case placement.KindLocal:
			// Counted until forward returns: the response, streamed or
			// not, is relayed before that.
			defer p.busy.add(role)()
			if rt != nil {
				rt.Attempt(target, true, c.Model, r.Header)
			}
			if rr != nil {
				p.kick(role) // counted: the next in line decides with it
			}
			resp, err = p.roundTripLocal(r, role, body, buf.model, c, source == sourcePeer)
		case placement.KindRemote:
			if p.cfg.Remote == nil {
				continue
			}
			target = c.Node
			if rt != nil {
				rt.Attempt(target, false, c.Model, r.Header)
			}
			defer p.dispatched(role, c)()
			if rr != nil {
				p.kick(role)
			}
			resp, err = p.roundTripRemote(r, role, body, c, tk.Name())
		default:
			continue
		}
		tried++
		if obs := p.cfg.Observer; obs != nil {
			st := 0
			if resp != nil {
				st = resp.StatusCode
			}
			obs.Attempt(role, target, st, err, time.Since(t0))
		}
		if err != nil {
			if r.Context().Err() != nil {
				// The client went away; nobody is left to answer.
				p.done(r, outcome(Outcome{Target: target, Status: 499, Aborted: true, Attempts: i + 1, Route: route}), start)
				return
			}
			if rt != nil {
				rt.AttemptFailed(0, err)
			}
			last = &attemptError{target: target, api: classify(err, target)}
			p.log.Debug("forward attempt failed", zap.String("role", role), zap.String("target", target), zap.Error(err))
			continue
		}
		if c.Kind == placement.KindRemote && p.cfg.OnLoadReport != nil {
			if v := headerValue(resp.Header, LoadHeader); v != "" {
				if lr, ok := ParseLoadReport(v); ok {
					if seq := p.cfg.OnLoadReport(role, target, lr); seq != 0 {
						p.router.takeReport(role, target, seq)
					}
					p.kick(role)
				}
			}
		}
		if why := headerValue(resp.Header, RefusedHeader); why != "" && c.Kind == placement.KindRemote {
			// The peer agent itself refused (policy, admission): it will not
			// serve this role to us, so another candidate may.
			_ = resp.Body.Close()
			if rt != nil {
				rt.AttemptFailed(resp.StatusCode, nil)
			}
			last = &attemptError{target: target, api: errPeerRefused(target, role, why)}
			continue
		}
		if resp.StatusCode == http.StatusServiceUnavailable && more {
			_ = resp.Body.Close()
			if rt != nil {
				rt.AttemptFailed(resp.StatusCode, nil)
			}
			last = &attemptError{target: target, api: errUpstream(target + " answered 503")}
			continue
		}
		release()
		if rr != nil {
			rr.learn(p.router, role, c, i, time.Since(t0), resp.StatusCode)
			if i > 0 {
				rr.info.Reason = string(routing.ReasonFailover)
			}
		}
		p.respond(w, r, outcome(Outcome{Target: target, Attempts: tried, Route: route}), resp, asked, c.Kind == placement.KindLocal && c.Model != "", c.Kind == placement.KindRemote, start)
		if rr != nil {
			rr.finish(p.router, role, c, i, time.Since(t0))
		}
		return
	}
	if last == nil {
		WriteError(w, errNoInstance(role))
		p.done(r, outcome(Outcome{Status: http.StatusServiceUnavailable, Attempts: tried, Route: route}), start)
		return
	}
	WriteError(w, last.api)
	p.done(r, outcome(Outcome{Target: last.target, Status: last.api.Status, Attempts: tried, Route: route}), start)
}

func (p *Proxy) done(r *http.Request, o Outcome, start time.Time) {
	if o.ticket != (clients.Ticket{}) {
		o.ticket.Done(charged(o, o.bodyLen))
	}
	obs := p.cfg.Observer
	if obs == nil && p.cfg.Tracer == nil {
		return
	}
	o.Duration = time.Since(start)
	o.RequestID = headerValue(r.Header, RequestIDHeader)
	if obs != nil {
		obs.Done(o)
	}
	if rt := p.requestTrace(r); rt != nil {
		rt.Outcome(o)
	}
}

// classify maps a transport error to the OpenAI-shaped error sent when no
// candidate is left.
func classify(err error, target string) *APIError {
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return errTimeout(target + ": timed out waiting for the instance")
	}
	return errUpstream(target + ": " + err.Error())
}

// pinnedBody returns body with its top-level model set to model.
func pinnedBody(dst, body []byte, model string) []byte {
	ms, me, found, err := modelSpan(body)
	return pinnedAt(dst, body, ms, me, found, err, model)
}

// pinnedAt is pinnedBody given modelSpan's answer for body (a request
// body's comes from its validation, bodyModel: no second scan).
func pinnedAt(dst, body []byte, ms, me int, found bool, err error, model string) []byte {
	if err != nil {
		return append(dst, body...)
	}
	if found {
		dst = append(dst, body[:ms]...)
		dst = appendJSONString(dst, model)
		return append(dst, body[me:]...)
	}
	// Insert the model as the object's first member.
	open := jsonskip.WS(body, 0)
	dst = append(dst, body[:open+1]...)
	dst = append(dst, `"model":`...)
	dst = appendJSONString(dst, model)
	rest := body[open+1:]
	if j := jsonskip.WS(rest, 0); j < len(rest) && rest[j] != '}' {
		dst = append(dst, ',')
	}
	return append(dst, rest...)
}

// instance is a parsed instance base URL.
type instance struct {
	u      *url.URL
	direct bool   // plain http: served by the proxy's own upstream client
	dial   string // host:port to dial
	prefix string // escaped path prefix of the base
}

// instanceCache holds parsed instance bases; bases rarely change.
var instanceCache sync.Map // string -> *instance

func baseInstance(base string) (*instance, error) {
	if in, ok := instanceCache.Load(base); ok {
		return in.(*instance), nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	in := &instance{u: u, direct: u.Scheme == "http" && u.User == nil, dial: u.Host, prefix: strings.TrimSuffix(u.EscapedPath(), "/")}
	if u.Port() == "" {
		in.dial = net.JoinHostPort(u.Hostname(), "80")
	}
	instanceCache.Store(base, in)
	return in, nil
}

// upstreamKey is role's instance API key, "" for none.
func (p *Proxy) upstreamKey(role string) string {
	if p.cfg.UpstreamKey == nil {
		return ""
	}
	return p.cfg.UpstreamKey(role)
}

// roundTripLocal sends body to the local instance c; m is body's model
// member, as readBody found it. A peer's request (fromPeer) carries only
// MeshHeaders and no query string on to the instance.
func (p *Proxy) roundTripLocal(r *http.Request, role string, body []byte, m jsonskip.Member, c placement.Candidate, fromPeer bool) (*http.Response, error) {
	in, err := baseInstance(c.Base)
	if err != nil {
		return nil, err
	}
	out := getBodyBuf()
	defer out.release()
	if c.Model != "" {
		ms, me, found, err := bodyModel(m)
		out.b = pinnedAt(out.b[:0], body, ms, me, found, err, c.Model)
	} else {
		out.b = append(out.b[:0], body...)
	}
	if !in.direct || p.cfg.Server == ServerStd {
		bu := in.u
		u := &url.URL{Scheme: bu.Scheme, Host: bu.Host, User: bu.User, Path: bu.Path + r.URL.Path}
		if !fromPeer {
			u.RawQuery = r.URL.RawQuery
		}
		req := p.outRequest(r, u, out, fromPeer)
		if key := p.upstreamKey(role); key != "" {
			req.Header["Authorization"] = []string{"Bearer " + key}
		}
		return p.local.RoundTrip(req)
	}
	// The whole request, head and body, in one buffer: one write.
	req := getBodyBuf()
	defer req.release()
	req.b = appendRequestHead(req.b[:0], r, in.u.Host, in.prefix+r.URL.Path, len(out.b), p.upstreamKey(role), fromPeer)
	req.b = append(req.b, out.b...)
	return p.up.roundTrip(r.Context(), in.dial, req.b, replayable(r.Header))
}

func (p *Proxy) roundTripRemote(r *http.Request, role string, body []byte, c placement.Candidate, client string) (*http.Response, error) {
	out := getBodyBuf()
	out.b = append(out.b[:0], body...)
	defer out.release()
	// No query string: it does not cross the hop (see MeshHeaders).
	u := &url.URL{Scheme: "https", Host: c.Node, Path: r.URL.Path}
	req := p.outRequest(r, u, out, true)
	req.Header[RoleHeader] = []string{role}
	if client != "" {
		req.Header[ClientHeader] = []string{client}
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		// An empty value sends none: the HTTP/3 client would add its own,
		// and the peer's instance would see it for the app's.
		req.Header["User-Agent"] = []string{""}
	}
	return p.cfg.Remote.RoundTrip(req)
}

// outRequest is the request http.Transport (or the mesh) sends to u; mesh
// keeps MeshHeaders only (a request to a peer, or a peer's to the local
// instance).
func (p *Proxy) outRequest(r *http.Request, u *url.URL, out *bodyBuf, mesh bool) *http.Request {
	h := make(http.Header, len(r.Header)+2)
	copyHeaders(h, r.Header, mesh)
	// Not marked replayable: http.Transport sends it again only when none
	// of it was written, or when the client's own Idempotency-Key says so.
	h["Content-Type"] = []string{"application/json"}
	data := out.b
	req := &http.Request{
		Method:        http.MethodPost,
		URL:           u,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Host:          u.Host,
		ContentLength: int64(len(data)),
		Body:          out.reader(data),
		GetBody:       func() (io.ReadCloser, error) { return out.reader(data), nil },
	}
	return req.WithContext(r.Context())
}

// respond relays resp to the client. rewrite says the instance was pinned to
// its own model name, so the name the client asked for (asked, a JSON string
// literal) is put back into the JSON body or into every SSE event. peer
// says resp is a peer agent's answer (target is the node it was verified
// as): only PeerResponseHeaders pass, and the response names target as the
// node that served it.
func (p *Proxy) respond(w http.ResponseWriter, r *http.Request, o Outcome, resp *http.Response, asked []byte, rewrite, peer bool, start time.Time) {
	defer resp.Body.Close()
	role, source, target := o.Role, o.Source, o.Target
	h := w.Header()
	copyResponseHeaders(h, resp.Header, peer)
	if peer {
		h[ServedByHeader] = []string{target}
	}
	if source == sourcePeer && p.cfg.LoadReport != nil {
		// Our answer to a peer: its consumer's view of us, fresher than
		// our adverts.
		h[LoadHeader] = []string{p.cfg.LoadReport(role).String()}
	}
	ct := headerValue(resp.Header, "Content-Type")
	sse := strings.HasPrefix(ct, "text/event-stream")
	isJSON := strings.HasPrefix(ct, "application/json")
	o.Status = resp.StatusCode

	var body io.Reader = resp.Body
	pinStream := false // the answer's model is rewritten as it streams
	if rewrite && isJSON && !sse {
		buf := getBodyBuf()
		defer buf.release()
		var b []byte
		whole := false
		var err error
		if resp.ContentLength <= pinnedHoldMax {
			b, whole, err = readPinned(buf.b[:0], resp.Body, resp.ContentLength, pinnedHoldMax)
			buf.b = b
		}
		if err != nil {
			// Nothing was sent yet: the client gets a clean error.
			WriteError(w, errUpstream(target+": reading response: "+err.Error()))
			o.Status = http.StatusBadGateway
			p.done(r, o, start)
			return
		}
		if whole {
			if p.meterUsage && resp.StatusCode < 300 {
				o.PromptTokens, o.CompletionTokens, o.Usage = lastUsage(b)
			}
			b = rewriteModel(b, asked)
			h["Content-Length"] = []string{strconv.Itoa(len(b))}
			w.WriteHeader(resp.StatusCode)
			n, _ := w.Write(b)
			o.Bytes = int64(n)
			p.done(r, o, start)
			return
		}
		// Too large to hold: what was read goes first, then the rest, and
		// the length the rewrite gives is not known up front.
		pinStream = true
		if len(b) > 0 {
			body = io.MultiReader(bytes.NewReader(b), resp.Body)
		}
	}

	if resp.ContentLength >= 0 && !sse && !pinStream {
		h["Content-Length"] = []string{strconv.FormatInt(resp.ContentLength, 10)}
	}
	if sse {
		delete(h, "Content-Length")
		if obs := p.cfg.Observer; obs != nil {
			obs.StreamOpen(role)
			defer obs.StreamClose(role)
		}
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	// With an observer, the body goes through a meter: the first SSE event
	// and the tail, where the instance reports usage.
	var dst io.Writer = w
	var m *meter
	if p.meterUsage && resp.StatusCode < 300 && (sse || isJSON) {
		m = getMeter(w, sse, start)
		defer m.release()
		dst = m
	}
	var n int64
	var err error
	switch {
	case sse:
		_ = rc.Flush()
		n, err = copySSE(dst, rc, body, asked, rewrite)
	case pinStream:
		ms := &modelStream{w: dst, lit: asked}
		_, err = copyFlush(ms, rc, body, false)
		n = ms.n
	default:
		n, err = copyFlush(dst, rc, body, false)
	}
	o.Bytes = n
	if m != nil {
		o.FirstEvent = m.first
		if err == nil {
			o.PromptTokens, o.CompletionTokens, o.Usage = lastUsage(m.Tail())
		}
	}
	if err != nil {
		o.Aborted = true
		p.done(r, o, start)
		if r.Context().Err() != nil {
			return // the client left; its request context already cancelled the upstream
		}
		p.log.Warn("upstream failed mid-response; aborting the client's response",
			zap.String("role", role), zap.String("target", target), zap.Error(err))
		// Abort: the client must see a broken response, never a clean end
		// (for SSE a missing [DONE]; for HTTP/1.1 an unterminated chunked body).
		panic(http.ErrAbortHandler)
	}
	p.done(r, o, start)
}

var errClientGone = errors.New("client write failed")

// Copy buffers. Every open stream holds a stream buffer (and, rewritten,
// an SSE line reader too) on each agent it passes, so they are 2 KiB:
// more than an SSE event of a chat completion, and a relay of a remote
// stream holds them on both agents.
var (
	copyBufPool   = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
	streamBufPool = sync.Pool{New: func() any { b := make([]byte, 2<<10); return &b }}
)

// copyFlush copies src to w, flushing whenever src has nothing more ready.
// Streams (flushEach) use a small buffer: an open stream holds it.
func copyFlush(w io.Writer, rc *http.ResponseController, src io.Reader, flushEach bool) (int64, error) {
	pool := &copyBufPool
	if flushEach {
		pool = &streamBufPool
	}
	bp := pool.Get().(*[]byte)
	defer pool.Put(bp)
	// Whole capacity: copySSE puts its buffers back emptied (len 0), and a
	// zero-length read buffer would spin forever on a live stream.
	buf := (*bp)[:cap(*bp)]
	var n int64
	for {
		m, rerr := src.Read(buf)
		if m > 0 {
			k, werr := w.Write(buf[:m])
			n += int64(k)
			if werr != nil {
				return n, errClientGone
			}
			if flushEach {
				if err := rc.Flush(); err != nil {
					return n, errClientGone
				}
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// sseReaderPool holds the line readers of SSE relays. They are small
// because an open stream holds one; a longer line is gathered into a
// separate buffer (up to maxSSELine) so it is still rewritten whole.
var sseReaderPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 2<<10) }}

// maxSSELine bounds the line an SSE relay gathers to rewrite. A longer
// line cannot be rewritten within the bound, and passing it through would
// show the client the instance's own model name: the stream is cut with an
// error event instead (errSSELineTooLong).
const maxSSELine = 1 << 20

// errSSELineTooLong ends a relay that met a line over maxSSELine.
var errSSELineTooLong = errors.New("an event line from the instance is over 1 MiB")

// sseLineTooLongEvent is the error event a cut stream ends with, in the
// shape OpenAI's SDKs raise as an API error.
const sseLineTooLongEvent = `data: {"error":{"message":"infermesh: an event line from the instance is over 1 MiB and cannot be relayed; the stream was cut","type":"server_error","param":null,"code":"sse_line_too_long"}}` + "\n\n"

// copySSE relays a server-sent event stream line by line: comments, unknown
// fields and [DONE] pass through untouched, and when rewrite is set the
// top-level model of every JSON data line is replaced by asked. Each event
// goes out in one write (a peer's HTTP/3 relay sends one frame per write),
// flushed at its end or whenever the upstream has nothing more buffered, so
// events go out as they arrive and are never held back.
func copySSE(w io.Writer, rc *http.ResponseController, src io.Reader, asked []byte, rewrite bool) (int64, error) {
	if !rewrite {
		return copyFlush(w, rc, src, true)
	}
	br := sseReaderPool.Get().(*bufio.Reader)
	br.Reset(src)
	defer func() { br.Reset(nil); sseReaderPool.Put(br) }()
	bp := streamBufPool.Get().(*[]byte)
	out := (*bp)[:0]
	defer func() {
		if cap(out) <= 64<<10 {
			*bp = out[:cap(out)] // copyFlush reads into the whole slice
		}
		streamBufPool.Put(bp)
	}()
	var n int64
	send := func() error {
		if len(out) > 0 {
			k, werr := w.Write(out)
			n += int64(k)
			out = out[:0]
			if werr != nil {
				return errClientGone
			}
		}
		if err := rc.Flush(); err != nil {
			return errClientGone
		}
		return nil
	}
	var long []byte
	for {
		line, rerr := br.ReadSlice('\n')
		if rerr == bufio.ErrBufferFull {
			// A line longer than the reader's buffer: gather it.
			long = append(long[:0], line...)
			for rerr == bufio.ErrBufferFull {
				if len(long) > maxSSELine {
					out = append(out[:0], sseLineTooLongEvent...)
					if err := send(); err != nil {
						return n, err
					}
					return n, errSSELineTooLong
				}
				line, rerr = br.ReadSlice('\n')
				long = append(long, line...)
			}
			line = long
		}
		if len(line) > 0 {
			j := 0
			if rerr == nil && len(line) > 6 && string(line[:5]) == "data:" {
				j = 5
				if line[j] == ' ' {
					j++
				}
			}
			if j > 0 && j < len(line) && line[j] == '{' {
				out = append(out, line[:j]...)
				out = append(out, rewriteModel(line[j:], asked)...)
			} else {
				out = append(out, line...)
			}
			if emptyLine(line) || br.Buffered() == 0 {
				// The end of an event, or nothing more is ready.
				if err := send(); err != nil {
					return n, err
				}
			}
		}
		switch {
		case rerr == nil:
		case rerr == io.EOF:
			return n, send()
		default:
			return n, rerr
		}
	}
}
