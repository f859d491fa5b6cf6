package admin

import (
	"context"
	"net/http"
	"time"
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

// The mesh view over the admin API: GET /v0/mesh lists every node this
// agent knows with what it serves, to us or not, its load, version,
// certificate expiry, when it was last heard and the round-trip time to it
// (`infermesh mesh`).

// MeshViewer is the part of Backend that gives the mesh view. A backend
// without it answers ErrNotConfigured.
type MeshViewer interface {
	MeshView(ctx context.Context) (MeshView, error)
}

// MeshView is GET /v0/mesh's answer.
type MeshView struct {
	Node  string     `json:"node"` // this node
	Nodes []MeshNode `json:"nodes"`
}

// MeshNode is one node as this agent sees it: from gossip (membership,
// adverts, probes) and, for admitted peers, from their answer to the info
// call over QUIC.
type MeshNode struct {
	Name  string `json:"name"`
	State string `json:"state"` // self, admitted, not_admitted, refused (as Peer's)
	Scope string `json:"scope,omitempty"`
	Why   string `json:"why,omitempty"` // why not admitted or refused
	// Version and StartedAt come from the info call ("" and nil when the
	// node was not asked or did not answer; InfoError says why).
	Version   string     `json:"version,omitempty"`
	StartedAt *time.Time `json:"started_at,omitempty"`
	InfoError string     `json:"info_error,omitempty"`
	// CertExpires is when the node's admission certificate expires (nil:
	// it gossips none, static trust).
	CertExpires *time.Time `json:"cert_expires,omitempty"`
	// LastHeard is when gossip last heard the node directly: its answer to
	// a probe or its newest advert, whichever is later.
	LastHeard *time.Time `json:"last_heard,omitempty"`
	// RTTMillis is the smoothed round-trip time of gossip's probes (0:
	// none measured yet, or this node).
	RTTMillis float64    `json:"rtt_ms,omitempty"`
	Roles     []MeshRole `json:"roles"`
	// Uses: the roles the node's apps use and who serves each to it now
	// (this node's own table; a peer's info answer).
	Uses []MeshUse `json:"uses,omitempty"`
}

// MeshUse is a role a node uses and the nodes serving it to that node, in
// the order its proxy tries them (the node itself for its own instance).
type MeshUse struct {
	Role  string   `json:"role"`
	Nodes []string `json:"nodes"`
}

// MeshRole is a role a node serves from an instance of its own.
type MeshRole struct {
	Name  string `json:"name"`
	Model string `json:"model,omitempty"`
	// ServesUs: the node is a candidate for the role here now (for this
	// node: its own instance is). Why says why not.
	ServesUs bool     `json:"serves_us"`
	Why      []string `json:"why,omitempty"`
	// Load is the in-flight count its advert carries; InFlight the count
	// its info answer gave (fresher), when it answered.
	Load     uint32  `json:"load"`
	InFlight *uint32 `json:"in_flight,omitempty"`
	// Capacity is what the node's instance reports of its slots, queue
	// and cache (nil: unknown).
	Capacity *Capacity `json:"capacity,omitempty"`
}

// MeshView is GET /v0/mesh.
func (c *Client) MeshView(ctx context.Context) (MeshView, error) {
	return get[MeshView](ctx, c, "/v0/mesh")
}

func (s *Server) meshViewRoutes(mux *http.ServeMux) {
	v, ok := s.cfg.Backend.(MeshViewer)
	mux.HandleFunc("GET /v0/mesh", s.guard(false, func(w http.ResponseWriter, r *http.Request, _ Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "this agent gives no mesh view"))
			return
		}
		reply(w, r, v.MeshView)
	}))
}

// The web console's address over the admin API: GET /v0/console answers
// its URL with the token (`infermesh console`); admin readers may ask, as
// the console only reads too.

// ConsoleBackend is the part of Backend that knows the console.
type ConsoleBackend interface {
	Console(ctx context.Context) (ConsoleInfo, error)
}

// ConsoleInfo is GET /v0/console's answer.
type ConsoleInfo struct {
	URL       string `json:"url"`        // with ?token=
	TokenFile string `json:"token_file"` // where the agent keeps the token (0600)
}

// Console is GET /v0/console.
func (c *Client) Console(ctx context.Context) (ConsoleInfo, error) {
	return get[ConsoleInfo](ctx, c, "/v0/console")
}

func (s *Server) consoleRoutes(mux *http.ServeMux) {
	b, ok := s.cfg.Backend.(ConsoleBackend)
	mux.HandleFunc("GET /v0/console", s.guard(false, func(w http.ResponseWriter, r *http.Request, _ Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "this agent has no console"))
			return
		}
		reply(w, r, b.Console)
	}))
}
