package proxy

import (
	"net/http"
	"strings"
	"time"

	"github.com/infermesh/infermesh/clients"
)

// Who is calling (package clients decides): an app's request is admitted
// as one of this host's clients, under its limits, before its body is
// read; a peer's request names, in ClientHeader, the client of the
// consumer node it came from, which the serving node records as that
// node's word and nothing more.

// ClientHeader names, on a request forwarded to a peer, the client of
// this host the request came from: its name, never its key.
const ClientHeader = "Infermesh-Client"

// requestKey is the API key a request presents: Authorization's bearer
// token, else the api-key header (Azure's form, which OpenAI's SDKs send
// for Azure endpoints); "" when there is none.
func requestKey(h http.Header) string {
	if v := headerValue(h, "Authorization"); v != "" {
		if len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
			return strings.TrimSpace(v[7:])
		}
		return ""
	}
	return strings.TrimSpace(headerValue(h, "Api-Key"))
}

// caller is who sent r, as far as its connection and headers say.
func caller(r *http.Request) clients.Caller {
	c := clients.Caller{Key: requestKey(r.Header)}
	if cr, ok := unixCreds(r); ok {
		c.HasCreds, c.UID, c.Unit = true, cr.uid, cr.unit
	}
	return c
}

// admit takes an app's request of role under its client's limits (no
// registry: every request is welcome, as no client). The client's key,
// when it named the client, is removed from the request: it is this
// host's secret and reaches neither the instance nor a peer.
func (p *Proxy) admit(w http.ResponseWriter, r *http.Request, role string) (clients.Ticket, *APIError) {
	reg := p.cfg.Clients
	if reg == nil {
		return clients.Ticket{}, nil
	}
	tk, ref := reg.Admit(caller(r), role)
	if ref != nil {
		noteClient(w, tk.Name(), "")
		return clients.Ticket{}, refusalError(ref)
	}
	if tk.ByKey() {
		delete(r.Header, "Authorization")
		delete(r.Header, "Api-Key")
	}
	noteClient(w, tk.Name(), "")
	if h := tk.RateHeaders(nil); len(h) > 0 {
		wh := w.Header()
		for _, x := range h {
			wh[x.Name] = []string{x.Value}
		}
	}
	return tk, nil
}

// identify is admit without taking a request (GET /v1/models): only the
// key is checked.
func (p *Proxy) identify(w http.ResponseWriter, r *http.Request) *APIError {
	if p.cfg.Clients == nil {
		return nil
	}
	name, ref := p.cfg.Clients.Identify(caller(r))
	noteClient(w, name, "")
	if ref != nil {
		return refusalError(ref)
	}
	return nil
}

func refusalError(f *clients.Refusal) *APIError {
	e := &APIError{Status: f.Status, Type: f.Type, Code: f.Code, Message: f.Message, Headers: f.Headers}
	if f.RetryAfter > 0 {
		e.RetryAfter = f.RetryAfterSeconds()
		// Rounded up, and a millisecond more: a retry at the very
		// instant the bucket refills one would find it a hair short.
		e.RetryAfterMs = int64((f.RetryAfter+time.Millisecond-1)/time.Millisecond) + 1
	}
	return e
}

// peerClient is the client a peer's request names (ClientHeader), "" when
// none or not a name.
func peerClient(r *http.Request) string {
	if v := headerValue(r.Header, ClientHeader); clients.ValidName(v) {
		return v
	}
	return ""
}

// noteClient tells the access log who sent the request: client, and the
// node whose word that is ("" for this host).
func noteClient(w http.ResponseWriter, client, node string) {
	if rw, ok := w.(*reqWriter); ok {
		rw.client, rw.clientNode = client, node
	}
}

// charged is what an ended request costs its client in tokens: the
// usage its instance reported, else an estimate of the prompt's (a
// stream that asked for no usage): a byte in four.
func charged(o Outcome, bodyLen int) (prompt, completion int64) {
	if o.Usage {
		return o.PromptTokens, o.CompletionTokens
	}
	if o.Target == "" {
		return 0, 0 // no candidate saw it
	}
	return int64(bodyLen / 4), 0
}
