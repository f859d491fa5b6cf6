package admin

import (
	"context"
	"net/http"
	"net/url"
	"time"
)

// One request's route decision: GET /v0/route/{role}/request/{id} answers
// every candidate's estimate for a request this agent routed recently
// (`infermesh route ROLE --request ID`), from a bounded ring.

// RouteRequester is the part of Backend that keeps recent decisions. A
// backend without it answers ErrNotConfigured.
type RouteRequester interface {
	RouteRequest(ctx context.Context, role, id string) (RouteDecision, error)
}

// RouteDecision is how one request's candidate was chosen.
type RouteDecision struct {
	ID   string    `json:"id"` // X-Request-Id
	Role string    `json:"role"`
	Time time.Time `json:"time"` // when it finished
	// Policy: auto, local-first or least-loaded.
	Policy string `json:"policy"`
	// Reason the candidate that answered was chosen: local, affinity,
	// least-ttft, spill, queued, failover, least-loaded, order.
	Reason string `json:"reason"`
	// Key is where the affinity key came from: none, prompt_cache_key,
	// user or prefix; Tokens the prompt's estimated tokens.
	Key          string  `json:"key"`
	Tokens       int     `json:"tokens"`
	QueuedMillis float64 `json:"queued_ms,omitempty"`
	// Target answered it (local, a peer, "" when none did) with Status.
	Target string `json:"target"`
	Status int    `json:"status"`
	// Candidates in the order they were to be tried.
	Candidates []RouteEstimate `json:"candidates"`
}

// RouteEstimate is one candidate's estimated time to the first token, in
// parts.
type RouteEstimate struct {
	Target         string  `json:"target"`
	Estimated      bool    `json:"estimated"` // false under local-first: nothing was estimated
	EstimateMillis float64 `json:"estimate_ms"`
	QueueMillis    float64 `json:"queue_ms"`
	PrefillMillis  float64 `json:"prefill_ms"`
	NetworkMillis  float64 `json:"network_ms"`
	PenaltyMillis  float64 `json:"penalty_ms,omitempty"`
	// CachedTokens is the prompt's part the candidate was expected to hold.
	CachedTokens int    `json:"cached_tokens"`
	InFlight     uint32 `json:"in_flight"`
	Slots        uint32 `json:"slots"` // 0: unknown
	Full         bool   `json:"full,omitempty"`
	Affine       bool   `json:"affine,omitempty"` // the request's affinity key's peer
}

// RouteRequest is GET /v0/route/{role}/request/{id}.
func (c *Client) RouteRequest(ctx context.Context, role, id string) (RouteDecision, error) {
	return get[RouteDecision](ctx, c, "/v0/route/"+url.PathEscape(role)+"/request/"+url.PathEscape(id))
}

func (s *Server) routeRequestRoutes(mux *http.ServeMux) {
	v, ok := s.cfg.Backend.(RouteRequester)
	mux.HandleFunc("GET /v0/route/{role}/request/{id}", s.guard(false, func(w http.ResponseWriter, r *http.Request, _ Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "this agent keeps no route decisions"))
			return
		}
		reply(w, r, func(ctx context.Context) (RouteDecision, error) {
			return v.RouteRequest(ctx, r.PathValue("role"), r.PathValue("id"))
		})
	}))
}
