package admin

import (
	"context"
	"net/http"
)

// Mesh membership over the admin API: POST /v0/join contacts gossip
// addresses now and keeps them among the addresses the agent rejoins.

// MeshBackend is the part of Backend that acts on mesh membership. Errors
// wrap the same kinds as the rest of Backend.
type MeshBackend interface {
	// Join contacts addrs now; they are also kept among the addresses the
	// agent rejoins whenever they are not live members.
	Join(ctx context.Context, by Caller, req JoinRequest) (JoinResult, error)
}

// JoinRequest is POST /v0/join.
type JoinRequest struct {
	Addrs []string `json:"addrs"` // gossip addresses, host:port
}

// JoinResult is POST /v0/join's answer.
type JoinResult struct {
	Contacted int      `json:"contacted"` // addresses that answered
	Members   []string `json:"members"`   // live members after the join, this node included
}

// Join is POST /v0/join.
func (c *Client) Join(ctx context.Context, addrs []string) (JoinResult, error) {
	return post[JoinResult](ctx, c, "/v0/join", JoinRequest{Addrs: addrs})
}

func (s *Server) meshRoutes(mux *http.ServeMux) {
	b, ok := s.cfg.Backend.(MeshBackend)
	mux.HandleFunc("POST /v0/join", s.guard(true, func(w http.ResponseWriter, r *http.Request, c Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "the mesh is not configured on this node"))
			return
		}
		var req JoinRequest
		if decode(w, r, &req) {
			if len(req.Addrs) == 0 {
				writeError(w, Errorf(ErrInvalid, "addrs: at least one gossip address (host:port) is required"))
				return
			}
			reply(w, r, func(ctx context.Context) (JoinResult, error) { return b.Join(ctx, c, req) })
		}
	}))
}
