package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/infermesh/infermesh/clients"
	"github.com/infermesh/infermesh/internal/jsonskip"
	"github.com/infermesh/infermesh/placement"
)

// The OpenAI endpoints infermesh forwards.
const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"
	pathEmbeddings  = "/v1/embeddings"
	pathModels      = "/v1/models"
)

// RoleHeader names the role on a request forwarded to a peer agent.
const RoleHeader = "Infermesh-Role"

// RefusedHeader marks an answer as a refusal by the peer agent itself (not
// by its instance): the role is not served to the asking node, or the node
// is not admitted. Its value is the reason (RefusedNotServed, ...). The
// consumer treats such an answer as a failure before the first byte and
// tries its next candidate; an instance's own answers never carry it (the
// header is stripped from everything relayed).
const RefusedHeader = "Infermesh-Refused"

// Refusal reasons a peer agent sends in RefusedHeader.
const (
	RefusedNotServed   = "not_served"   // the role is not served to the asking node
	RefusedNotAdmitted = "not_admitted" // the asking node is not admitted (any more)
	RefusedUnknownPeer = "unknown_peer" // the connection carries no verified identity
)

func forwardedPath(p string) bool {
	return p == pathChat || p == pathCompletions || p == pathEmbeddings
}

// appRoute is where an app's request on a loopback listener goes.
type appRoute uint8

const (
	appForward appRoute = iota // a POST to a forwarded path
	appModels                  // /v1/models and below
	appRefused                 // answered with the error routeApp returns
)

// routeApp is what every app-facing listener (a role's port, proxy.listen)
// checks first: a loopback Host header, no cross-origin browser request, a
// known path, POST (setting Allow when it is not).
func routeApp(w http.ResponseWriter, r *http.Request) (appRoute, *APIError) {
	switch path := r.URL.Path; {
	case !loopbackHost(r.Host):
		return appRefused, errForbidden("the Host header must name a loopback address")
	case !checkBrowserOrigin(headerValue(r.Header, "Origin")):
		return appRefused, errForbidden("cross-origin requests are refused")
	case path == pathModels || strings.HasPrefix(path, pathModels+"/"):
		return appModels, nil
	case !forwardedPath(path):
		return appRefused, errNotFound(path)
	case r.Method != http.MethodPost:
		w.Header().Set("Allow", http.MethodPost)
		return appRefused, errMethod(r.Method)
	}
	return appForward, nil
}

// RoleHandler returns the handler of role's loopback port.
func (p *Proxy) RoleHandler(role string) http.Handler {
	roleLit := quoteModel(role)
	// fail answers a request no candidate saw, and counts it (target
	// "none") so refusals show in the request metrics too.
	fail := func(w http.ResponseWriter, r *http.Request, e *APIError) {
		WriteError(w, e)
		o := Outcome{Role: role, Source: sourceApp, Status: e.Status, RequestID: headerValue(r.Header, RequestIDHeader)}
		if obs := p.cfg.Observer; obs != nil {
			obs.Done(o)
		}
		if rt := p.requestTrace(r); rt != nil {
			rt.Outcome(o)
		}
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch route, e := routeApp(w, r); route {
		case appModels:
			if e := p.identify(w, r); e != nil {
				WriteError(w, e)
				return
			}
			p.serveModels(w, r, role)
			return
		case appRefused:
			fail(w, r, e)
			return
		}
		tk, apiErr := p.admit(w, r, role)
		if apiErr != nil {
			fail(w, r, apiErr)
			return
		}
		buf, asked, apiErr := p.readModelRequest(r, roleLit)
		if apiErr != nil {
			tk.Done(0, 0)
			fail(w, r, apiErr)
			return
		}
		noteRequest(w, role, asked)
		cands := p.resolveForApp(role)
		var refused *APIError
		switch {
		case len(cands) == 0 && p.pinned(role, asked):
			refused = errNoInstance(role)
		case !bytes.Equal(asked, roleLit) && !modelKnown(asked, cands):
			refused = errModelNotFound(decodeModel(asked), role)
		case len(cands) == 0:
			refused = errNoInstance(role)
		}
		if refused != nil {
			buf.release()
			tk.Done(0, 0)
			fail(w, r, refused)
			return
		}
		p.forward(w, r, role, sourceApp, buf, asked, cands, tk)
	})
}

// readModelRequest reads the request body and the model the client asked
// for: a JSON string literal, echoed back in responses, that outlives the
// body (forward releases it early); dflt when the body names no model or
// names dflt itself.
func (p *Proxy) readModelRequest(r *http.Request, dflt []byte) (*bodyBuf, []byte, *APIError) {
	buf, apiErr := p.readBody(r)
	if apiErr != nil {
		return nil, nil, apiErr
	}
	ms, me, found, err := bodyModel(buf.model)
	if err != nil {
		buf.release()
		return nil, nil, errBadJSON("request body: " + err.Error())
	}
	if !found || bytes.Equal(buf.b[ms:me], dflt) {
		return buf, dflt, nil
	}
	return buf, bytes.Clone(buf.b[ms:me]), nil
}

// pinned reports whether lit names role's pinned model (PinnedModel).
func (p *Proxy) pinned(role string, lit []byte) bool {
	if p.cfg.PinnedModel == nil {
		return false
	}
	m := p.cfg.PinnedModel(role)
	return m != "" && decodeModel(lit) == m
}

// modelKnown reports whether lit names the model of one of the candidates.
func modelKnown(lit []byte, cands []placement.Candidate) bool {
	name := decodeModel(lit)
	if name == "" {
		return true
	}
	for _, c := range cands {
		if c.Model != "" && c.Model == name {
			return true
		}
	}
	return false
}

// PeerHandler serves requests forwarded by peer agents. identify returns the
// node id the connection was verified as (from TLS); it is the only identity
// trusted. The role comes from RoleHeader. A peer that may not use the role
// gets the same 404 as for a role that does not exist here, so it learns
// nothing about what this node serves. The request only ever reaches a local
// instance.
func (p *Proxy) PeerHandler(identify func(*http.Request) (string, bool), refused func(r *http.Request, peer, role, why string)) http.Handler {
	return p.traced("", sourcePeer, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		peer, ok := identify(r)
		if !ok {
			w.Header().Set(RefusedHeader, RefusedUnknownPeer)
			WriteError(w, errForbidden("peer identity unknown"))
			return
		}
		role := headerValue(r.Header, RoleHeader)
		if err := placement.ValidateRole(role); err != nil {
			WriteError(w, &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "bad_role", Message: "missing or invalid " + RoleHeader + " header"})
			return
		}
		if !forwardedPath(r.URL.Path) {
			WriteError(w, errNotFound(r.URL.Path))
			return
		}
		if r.Method != http.MethodPost {
			WriteError(w, errMethod(r.Method))
			return
		}
		var local placement.Local
		if p.cfg.Peers != nil {
			local, ok = p.cfg.Peers.LocalForPeer(role, peer)
		} else {
			ok = false
		}
		if !ok {
			if refused != nil {
				refused(r, peer, role, "role not served to this peer")
			}
			w.Header().Set(RefusedHeader, RefusedNotServed)
			WriteError(w, errRoleNotFound(role))
			return
		}
		buf, asked, apiErr := p.readModelRequest(r, quoteModel(role))
		if apiErr != nil {
			WriteError(w, apiErr)
			return
		}
		noteRequest(w, role, asked)
		if c := peerClient(r); c != "" {
			noteClient(w, c, peer) // the consumer's word, not a proof
		}
		cand := []placement.Candidate{{Kind: placement.KindLocal, Base: local.Base, Model: local.Model}}
		p.forward(w, r, role, sourcePeer, buf, asked, cand, clients.Ticket{})
	}))
}

// serveModels lists what the port serves: the role name, and the model names
// of its current candidates as aliases.
func (p *Proxy) serveModels(w http.ResponseWriter, r *http.Request, role string) {
	ids := []string{role}
	seen := map[string]bool{role: true}
	for _, c := range p.cfg.Resolver.Resolve(role) {
		if c.Model != "" && !seen[c.Model] {
			seen[c.Model] = true
			ids = append(ids, c.Model)
		}
	}
	writeModels(w, r, ids, func(id string) *APIError { return errModelNotFound(id, role) })
}

// writeModels answers GET /v1/models (the list of ids) or
// /v1/models/{id} (one of them, else notFound(id)).
func writeModels(w http.ResponseWriter, r *http.Request, ids []string, notFound func(id string) *APIError) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		WriteError(w, errMethod(r.Method))
		return
	}
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	data := make([]model, 0, len(ids))
	for _, id := range ids {
		data = append(data, model{ID: id, Object: "model", OwnedBy: "infermesh"})
	}
	if rest := r.URL.Path[len(pathModels):]; rest != "" {
		want := rest[1:]
		for _, m := range data {
			if m.ID == want {
				writeJSON(w, http.StatusOK, m)
				return
			}
		}
		WriteError(w, notFound(want))
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{"list", data})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		WriteError(w, errUpstream("encode: "+err.Error()))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// bodyBuf is a pooled, reference-counted request body. The handler holds one
// reference; every outgoing request body holds another until the transport
// closes it (which it may do after RoundTrip returns), so the bytes are never
// reused while a transport may still be writing them.
type bodyBuf struct {
	b    []byte
	refs atomic.Int32
	mem  *memBudget // what b's growth was charged to; nil: not charged
	held int64
	// model is the top-level "model" member readBody found in b while
	// validating it.
	model jsonskip.Member
}

var bodyPool = sync.Pool{New: func() any { return &bodyBuf{b: make([]byte, 0, 4096)} }}

func getBodyBuf() *bodyBuf {
	b := bodyPool.Get().(*bodyBuf)
	b.refs.Store(1)
	return b
}

func (b *bodyBuf) retain() { b.refs.Add(1) }

func (b *bodyBuf) release() {
	if b.refs.Add(-1) != 0 {
		return
	}
	if b.mem != nil {
		b.mem.give(b.held)
		b.mem, b.held = nil, 0
	}
	if cap(b.b) <= 1<<20 {
		b.b = b.b[:0]
		bodyPool.Put(b)
	}
}

// reader returns a fresh body reading b's bytes that holds a reference
// until closed.
func (b *bodyBuf) reader(data []byte) io.ReadCloser {
	b.retain()
	return &bufReader{buf: b, data: data}
}

type bufReader struct {
	buf    *bodyBuf
	data   []byte
	off    int
	closed atomic.Bool
}

func (r *bufReader) Read(p []byte) (int, error) {
	if r.off >= len(r.data) {
		return 0, io.EOF
	}
	n := copy(p, r.data[r.off:])
	r.off += n
	return n, nil
}

func (r *bufReader) Close() error {
	if r.closed.CompareAndSwap(false, true) {
		r.buf.release()
	}
	return nil
}

// memBudget bounds the memory held by request bodies in flight across
// the proxy. Safe for concurrent use.
type memBudget struct {
	max  int64
	used atomic.Int64
}

// take charges n bytes, or reports that they would exceed the bound.
func (m *memBudget) take(n int64) bool {
	if m.used.Add(n) > m.max {
		m.used.Add(-n)
		return false
	}
	return true
}

func (m *memBudget) give(n int64) { m.used.Add(-n) }

// bodyFree is the part of each body not charged to the memory bound: a
// flood of large bodies holding the bound cannot lock out ordinary
// requests, whose memory the connection cap bounds instead.
const bodyFree = 64 << 10

// charge charges buf's growth to its capacity c against m (past bodyFree).
func (buf *bodyBuf) charge(m *memBudget, c int) bool {
	if d := int64(c-bodyFree) - buf.held; d > 0 {
		if !m.take(d) {
			return false
		}
		buf.mem = m
		buf.held += d
	}
	return true
}

// readBody reads the whole request body within the configured limit. The
// buffer grows as bytes arrive, never to a declared length up front (a
// client may declare 16 MiB and send one byte), and every growth is
// charged to the proxy's body memory bound: above it the request is
// refused with 503 and Retry-After.
func (p *Proxy) readBody(r *http.Request) (*bodyBuf, *APIError) {
	limit := p.cfg.MaxBodyBytes
	if r.ContentLength > limit {
		return nil, errTooLarge(limit)
	}
	buf := getBodyBuf()
	if cap(buf.b) > bodyFree {
		buf.b = make([]byte, 0, 4096) // a big pooled buffer would be charged before any byte came
	}
	b := buf.b[:0]
	for {
		if len(b) == cap(b) {
			c := max(2*cap(b), 4096)
			if cl := r.ContentLength; cl > int64(len(b)) && int64(c) > cl {
				c = int(cl) // the declared length, once bytes came near it
			}
			if !buf.charge(p.bodyMem, c) {
				buf.b = b
				buf.release()
				return nil, errBusy()
			}
			nb := make([]byte, len(b), c)
			copy(nb, b)
			b = nb
		}
		n, err := r.Body.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if int64(len(b)) > limit {
			buf.b = b
			buf.release()
			return nil, errTooLarge(limit)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			buf.b = b
			buf.release()
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				return nil, errTooLarge(limit)
			}
			if isTimeout(err) {
				return nil, &APIError{Status: http.StatusRequestTimeout, Type: typeInvalidRequest, Code: "request_timeout", Message: "the request body did not arrive in time"}
			}
			return nil, &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "body_read_failed", Message: "reading request body: " + err.Error()}
		}
	}
	buf.b = b
	// One pass validates the body and finds its model.
	m, ok := jsonskip.ValidMember(b, "model")
	if !ok {
		buf.release()
		return nil, errBadJSON("request body is not valid JSON")
	}
	buf.model = m
	return buf, nil
}
