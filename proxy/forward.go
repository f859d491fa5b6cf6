package proxy

import (
	"bufio"
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

	"github.com/infermesh/infermesh/placement"
)

// hopHeaders are the hop-by-hop headers of RFC 9110 section 7.6.1; they
// describe one connection and are never forwarded.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// copyHeaders copies src into dst without hop-by-hop headers (including those
// src's Connection header names). skipAuth drops credentials meant for this
// hop only (an app's API key never leaves the host).
func copyHeaders(dst, src http.Header, skipAuth bool) {
	var connNamed []string
	if c := src["Connection"]; len(c) > 0 {
		for _, v := range c {
			for _, f := range strings.Split(v, ",") {
				if f = strings.TrimSpace(f); f != "" {
					connNamed = append(connNamed, http.CanonicalHeaderKey(f))
				}
			}
		}
	}
outer:
	for k, vv := range src {
		for _, h := range hopHeaders {
			if k == h {
				continue outer
			}
		}
		for _, h := range connNamed {
			if k == h {
				continue outer
			}
		}
		if skipAuth && (k == "Authorization" || k == "Cookie") {
			continue
		}
		switch k {
		case "Content-Length", "Host", RoleHeader:
			continue
		}
		dst[k] = vv
	}
}

// attemptError says why one candidate could not serve a request before any
// byte of its response reached the client, so the next may be tried.
type attemptError struct {
	target string
	api    *APIError
}

// forward tries the candidates in order. A candidate that fails before its
// response starts is skipped; once a response has started there is no retry,
// and a failure aborts the client's response.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, role string, body []byte, asked []byte, cands []placement.Candidate) {
	start := time.Now()
	var last *attemptError
	for i, c := range cands {
		more := i < len(cands)-1
		var resp *http.Response
		var err error
		target := "local"
		t0 := time.Now()
		switch c.Kind {
		case placement.KindLocal:
			resp, err = p.roundTripLocal(r, body, c)
		case placement.KindRemote:
			if p.cfg.Remote == nil {
				continue
			}
			target = c.Node
			resp, err = p.roundTripRemote(r, role, body, c)
		default:
			continue
		}
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
				p.done(role, target, 499, start, 0, true)
				return
			}
			last = &attemptError{target: target, api: classify(err, target)}
			p.log.Debug("forward attempt failed", zap.String("role", role), zap.String("target", target), zap.Error(err))
			continue
		}
		if resp.StatusCode == http.StatusServiceUnavailable && more {
			_ = resp.Body.Close()
			last = &attemptError{target: target, api: errUpstream(target + " answered 503")}
			continue
		}
		p.respond(w, r, role, target, resp, asked, c.Kind == placement.KindLocal && c.Model != "", start)
		return
	}
	if last == nil {
		WriteError(w, errNoInstance(role))
		p.done(role, "", http.StatusServiceUnavailable, start, 0, false)
		return
	}
	WriteError(w, last.api)
	p.done(role, last.target, last.api.Status, start, 0, false)
}

func (p *Proxy) done(role, target string, status int, start time.Time, n int64, aborted bool) {
	if obs := p.cfg.Observer; obs != nil {
		obs.Done(role, target, status, time.Since(start), n, aborted)
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
	if err != nil {
		return append(dst, body...)
	}
	if found {
		dst = append(dst, body[:ms]...)
		dst = appendJSONString(dst, model)
		return append(dst, body[me:]...)
	}
	// Insert the model as the object's first member.
	open := skipWS(body, 0)
	dst = append(dst, body[:open+1]...)
	dst = append(dst, `"model":`...)
	dst = appendJSONString(dst, model)
	rest := body[open+1:]
	if j := skipWS(rest, 0); j < len(rest) && rest[j] != '}' {
		dst = append(dst, ',')
	}
	return append(dst, rest...)
}

// urlCache holds parsed instance base URLs; bases rarely change.
var urlCache sync.Map // string -> *url.URL

func baseURL(base string) (*url.URL, error) {
	if u, ok := urlCache.Load(base); ok {
		return u.(*url.URL), nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	urlCache.Store(base, u)
	return u, nil
}

func (p *Proxy) roundTripLocal(r *http.Request, body []byte, c placement.Candidate) (*http.Response, error) {
	bu, err := baseURL(c.Base)
	if err != nil {
		return nil, err
	}
	out := getBodyBuf()
	if c.Model != "" {
		out.b = pinnedBody(out.b[:0], body, c.Model)
	} else {
		out.b = append(out.b[:0], body...)
	}
	defer out.release()
	u := &url.URL{Scheme: bu.Scheme, Host: bu.Host, Path: bu.Path + r.URL.Path, RawQuery: r.URL.RawQuery}
	return p.local.RoundTrip(p.outRequest(r, u, out, false))
}

func (p *Proxy) roundTripRemote(r *http.Request, role string, body []byte, c placement.Candidate) (*http.Response, error) {
	out := getBodyBuf()
	out.b = append(out.b[:0], body...)
	defer out.release()
	u := &url.URL{Scheme: "https", Host: c.Node, Path: r.URL.Path, RawQuery: r.URL.RawQuery}
	req := p.outRequest(r, u, out, true)
	req.Header[RoleHeader] = []string{role}
	return p.cfg.Remote.RoundTrip(req)
}

func (p *Proxy) outRequest(r *http.Request, u *url.URL, out *bodyBuf, remote bool) *http.Request {
	h := make(http.Header, len(r.Header)+2)
	copyHeaders(h, r.Header, remote)
	h["Content-Type"] = []string{"application/json"}
	// Marks the request replayable for the transport: a request that never
	// reached the instance (a keep-alive connection it had closed) is resent.
	// A nil value is not sent on the wire.
	h["X-Idempotency-Key"] = nil
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
// literal) is put back into the JSON body or into every SSE event.
func (p *Proxy) respond(w http.ResponseWriter, r *http.Request, role, target string, resp *http.Response, asked []byte, rewrite bool, start time.Time) {
	defer resp.Body.Close()
	h := w.Header()
	copyHeaders(h, resp.Header, false)
	ct := resp.Header.Get("Content-Type")
	sse := strings.HasPrefix(ct, "text/event-stream")
	isJSON := strings.HasPrefix(ct, "application/json")

	if rewrite && isJSON && !sse {
		b, err := readAllLimit(resp.Body, resp.ContentLength, 256<<20)
		if err != nil {
			// Nothing was sent yet: the client gets a clean error.
			WriteError(w, errUpstream(target+": reading response: "+err.Error()))
			p.done(role, target, http.StatusBadGateway, start, 0, false)
			return
		}
		b = rewriteModel(b, asked)
		h.Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(resp.StatusCode)
		n, _ := w.Write(b)
		p.done(role, target, resp.StatusCode, start, int64(n), false)
		return
	}

	if resp.ContentLength >= 0 && !sse {
		h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if sse {
		h.Del("Content-Length")
		if obs := p.cfg.Observer; obs != nil {
			obs.StreamOpen(role)
			defer obs.StreamClose(role)
		}
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	var n int64
	var err error
	if sse {
		_ = rc.Flush()
		n, err = copySSE(w, rc, resp.Body, asked, rewrite)
	} else {
		n, err = copyFlush(w, rc, resp.Body, false)
	}
	if err != nil {
		p.done(role, target, resp.StatusCode, start, n, true)
		if r.Context().Err() != nil {
			return // the client left; its request context already cancelled the upstream
		}
		p.log.Warn("upstream failed mid-response; aborting the client's response",
			zap.String("role", role), zap.String("target", target), zap.Error(err))
		// Abort: the client must see a broken response, never a clean end
		// (for SSE a missing [DONE]; for HTTP/1.1 an unterminated chunked body).
		panic(http.ErrAbortHandler)
	}
	p.done(role, target, resp.StatusCode, start, n, false)
}

var errClientGone = errors.New("client write failed")

// readAllLimit reads r fully, refusing more than limit bytes.
func readAllLimit(r io.Reader, hint int64, limit int64) ([]byte, error) {
	if hint < 0 || hint > limit {
		hint = 4096
	}
	b := make([]byte, 0, hint+1)
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if int64(len(b)) > limit {
			return nil, errors.New("response larger than the limit")
		}
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

var copyBufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyFlush copies src to w, flushing whenever src has nothing more ready.
func copyFlush(w io.Writer, rc *http.ResponseController, src io.Reader, flushEach bool) (int64, error) {
	bp := copyBufPool.Get().(*[]byte)
	defer copyBufPool.Put(bp)
	buf := *bp
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

var sseReaderPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 64<<10) }}

// copySSE relays a server-sent event stream line by line: comments, unknown
// fields and [DONE] pass through untouched, and when rewrite is set the
// top-level model of every JSON data line is replaced by asked. Output is
// flushed whenever the upstream has nothing more buffered, so events go out
// as they arrive and are never held back.
func copySSE(w io.Writer, rc *http.ResponseController, src io.Reader, asked []byte, rewrite bool) (int64, error) {
	if !rewrite {
		return copyFlush(w, rc, src, true)
	}
	br := sseReaderPool.Get().(*bufio.Reader)
	br.Reset(src)
	defer func() { br.Reset(nil); sseReaderPool.Put(br) }()
	var n int64
	for {
		line, rerr := br.ReadSlice('\n')
		if len(line) > 0 {
			if rerr == nil && len(line) > 6 && string(line[:5]) == "data:" {
				j := 5
				if line[j] == ' ' {
					j++
				}
				if j < len(line) && line[j] == '{' {
					rewritten := rewriteModel(line[j:], asked)
					if len(rewritten) != len(line)-j || &rewritten[0] != &line[j] {
						// rewriteModel grew the line into a new slice, or
						// shrank it in place.
						k, werr := w.Write(line[:j])
						n += int64(k)
						if werr != nil {
							return n, errClientGone
						}
						line = rewritten
					}
				}
			}
			k, werr := w.Write(line)
			n += int64(k)
			if werr != nil {
				return n, errClientGone
			}
			if br.Buffered() == 0 {
				if err := rc.Flush(); err != nil {
					return n, errClientGone
				}
			}
		}
		switch {
		case rerr == nil, errors.Is(rerr, bufio.ErrBufferFull):
		case rerr == io.EOF:
			_ = rc.Flush()
			return n, nil
		default:
			return n, rerr
		}
	}
}
