package mesh

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"
)

// The info call: what an admitted peer tells about itself that adverts do
// not carry (its version, when it started, its roles' load right now), for
// an operator's view of the whole mesh (`infermesh mesh`). It is a GET of
// infoPath over the pinned QUIC connection, served like the liveness probe
// to verified peers that are still admitted, before the peer handler and
// outside the peer's stream bounds: it is small, read-only and asked for
// by an operator, not by routing. A peer that is not admitted is never
// asked and never answered.

// infoPath is the info call's path.
const infoPath = "/.well-known/infermesh/info"

// maxInfoBytes bounds an info answer read from a peer.
const maxInfoBytes = 64 << 10

// NodeInfo is a node's answer to the info call.
type NodeInfo struct {
	Name      string     `json:"name"`
	Version   string     `json:"version"`
	StartedAt time.Time  `json:"started_at"`
	Roles     []RoleInfo `json:"roles"`
	// Uses lists the roles its apps use and the nodes that serve each to
	// it now, in the order its proxy tries them (this node's name for its
	// own instance): the arrows of a map of the mesh.
	Uses []RoleUse `json:"uses,omitempty"`
}

// RoleUse is a role a node's apps use and who serves it to that node.
type RoleUse struct {
	Role  string   `json:"role"`
	Nodes []string `json:"nodes"`
}

// RoleInfo is one role a node serves from its own instance, as the info
// call reports it.
type RoleInfo struct {
	Name     string `json:"name"`
	Model    string `json:"model,omitempty"`
	InFlight uint32 `json:"in_flight"` // requests at the instance through this agent now
}

// serveInfo answers the info call from TransportConfig.Info.
func (t *Transport) serveInfo(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		writePeerError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "the info call is a GET")
		return
	}
	if t.cfg.Info == nil {
		writePeerError(w, http.StatusNotFound, "not_found_error", "unknown_url", "this node gives no info")
		return
	}
	b, err := json.Marshal(t.cfg.Info())
	if err != nil {
		writePeerError(w, http.StatusInternalServerError, "server_error", "internal", "info: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

// Info asks node, an admitted live member, for its NodeInfo over QUIC.
// The answer must name node itself.
func (t *Transport) Info(ctx context.Context, node string) (NodeInfo, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+node+infoPath, nil)
	if err != nil {
		return NodeInfo{}, err
	}
	resp, err := t.RoundTrip(req)
	if err != nil {
		return NodeInfo{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxInfoBytes+1))
	if err != nil {
		return NodeInfo{}, fmt.Errorf("%s: reading its info: %w", node, err)
	}
	if resp.StatusCode != http.StatusOK {
		return NodeInfo{}, fmt.Errorf("%s answered the info call with %s", node, resp.Status)
	}
	if len(b) > maxInfoBytes {
		return NodeInfo{}, fmt.Errorf("%s: its info is over %d bytes", node, maxInfoBytes)
	}
	var ni NodeInfo
	if err := json.Unmarshal(b, &ni); err != nil {
		return NodeInfo{}, fmt.Errorf("%s: its info: %w", node, err)
	}
	if ni.Name != node {
		return NodeInfo{}, fmt.Errorf("%s: its info names %q", node, ni.Name)
	}
	return ni, nil
}
