package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"sync"

	"github.com/infermesh/infermesh/placement"
)

// The shared port (proxy.listen): one loopback base URL for every role, as
// apps used to LiteLLM or Ollama expect. A request goes to the role its
// model names: a role's name, else a model an instance of a role serves
// now (or a role's pinned model while its instance is down). From there it
// is the role port's request: the same handler, placement and forwarding.

// sharedKey is the shared listener's key among the role servers; role
// names are never empty.
const sharedKey = ""

// ListenShared binds the shared loopback listener on addr. roles lists the
// roles it routes to (this node's configured roles); it is called per
// request and must be safe for concurrent use.
func (p *Proxy) ListenShared(addr string, roles func() []string) (net.Addr, error) {
	if !IsLoopbackAddr(addr) {
		return nil, fmt.Errorf("proxy.listen: %q is not a loopback address", addr)
	}
	return p.listen(sharedKey, addr, p.ProbeHandler(roles, p.traced("", sourceApp, p.sharedHandler(roles))))
}

// SharedAddr returns the bound address of the shared listener.
func (p *Proxy) SharedAddr() (net.Addr, bool) { return p.Addr(sharedKey) }

func (p *Proxy) sharedHandler(roles func() []string) http.Handler {
	var handlers sync.Map // role -> http.Handler: one RoleHandler per role
	roleHandler := func(role string) http.Handler {
		if h, ok := handlers.Load(role); ok {
			return h.(http.Handler)
		}
		h, _ := handlers.LoadOrStore(role, p.RoleHandler(role))
		return h.(http.Handler)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch route, e := routeApp(w, r); route {
		case appModels:
			if e := p.identify(w, r); e != nil {
				WriteError(w, e)
				return
			}
			p.serveSharedModels(w, r, roles())
			return
		case appRefused:
			WriteError(w, e)
			return
		}
		buf, apiErr := p.readBody(r)
		if apiErr != nil {
			WriteError(w, apiErr)
			return
		}
		defer buf.release()
		ms, me, found, err := bodyModel(buf.model)
		if err != nil {
			WriteError(w, errBadJSON("request body: "+err.Error()))
			return
		}
		if !found {
			WriteError(w, &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "model_required", Param: "model",
				Message: "the shared port routes by model: name a role or a model in \"model\""})
			return
		}
		model := decodeModel(buf.b[ms:me])
		role, ok := p.routeModel(model, roles())
		if !ok {
			WriteError(w, &APIError{Status: http.StatusNotFound, Type: typeInvalidRequest, Code: "model_not_found", Param: "model",
				Message: fmt.Sprintf("no role of this node is or serves the model %q (GET /v1/models lists them)", model)})
			return
		}
		// The role port's handler reads the body again from the buffer.
		r.Body = io.NopCloser(bytes.NewReader(buf.b))
		r.ContentLength = int64(len(buf.b))
		roleHandler(role).ServeHTTP(w, r)
	})
}

// routeModel picks the role a model names: a role of that name; else the
// first role (by name) with a candidate serving that model now; else the
// first whose pinned model it is (its instance is down: the role port
// answers 503 with Retry-After).
func (p *Proxy) routeModel(model string, roles []string) (string, bool) {
	sort.Strings(roles)
	for _, r := range roles {
		if r == model {
			return r, true
		}
	}
	for _, r := range roles {
		for _, c := range p.cfg.Resolver.Resolve(r) {
			if c.Model == model {
				return r, true
			}
		}
	}
	if p.cfg.PinnedModel != nil {
		for _, r := range roles {
			if m := p.cfg.PinnedModel(r); m != "" && m == model {
				return r, true
			}
		}
	}
	return "", false
}

// serveSharedModels lists every role this node can reach now (a local
// instance, or a peer allowed both ways: what placement resolves) and the
// models its candidates serve.
func (p *Proxy) serveSharedModels(w http.ResponseWriter, r *http.Request, roles []string) {
	sort.Strings(roles)
	var ids []string
	seen := map[string]bool{}
	for _, role := range roles {
		cands := p.cfg.Resolver.Resolve(role)
		if len(cands) == 0 {
			continue
		}
		for _, id := range append([]string{role}, candidateModels(cands)...) {
			if !seen[id] {
				seen[id] = true
				ids = append(ids, id)
			}
		}
	}
	writeModels(w, r, ids, func(id string) *APIError {
		return &APIError{Status: http.StatusNotFound, Type: typeInvalidRequest, Code: "model_not_found", Param: "model",
			Message: fmt.Sprintf("no role of this node is or serves the model %q now", id)}
	})
}

func candidateModels(cands []placement.Candidate) []string {
	var out []string
	for _, c := range cands {
		if c.Model != "" {
			out = append(out, c.Model)
		}
	}
	return out
}
