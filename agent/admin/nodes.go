package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// Node bootstrap over the admin API: POST /v0/nodes adds a node and
// streams its progress, GET /v0/nodes lists the recorded nodes, POST
// /v0/nodes/{name}/remove removes one, streaming too.

// NodeBackend is the part of Backend that adds and removes nodes. AddNode
// and RemoveNode call emit with every step until the node converged (or
// is gone), failed or ctx ended; an error before the first emit is an
// ordinary API error (invalid request, node exists, ...). Errors wrap the
// same kinds as the rest of Backend.
type NodeBackend interface {
	AddNode(ctx context.Context, by Caller, req NodeAdd, emit func(NodeEvent) error) error
	Nodes(ctx context.Context) (NodeList, error)
	RemoveNode(ctx context.Context, by Caller, name string, emit func(NodeEvent) error) error
}

// NodeAdd is POST /v0/nodes.
type NodeAdd struct {
	Name string `json:"name"`
	// Provider is docker (a node container on the agent's host) or ssh
	// (an existing host).
	Provider string `json:"provider"`
	// SSH is user@host[:port] (ssh provider).
	SSH string `json:"ssh,omitempty"`
	// HostKeys and HostKeyFingerprints pin the ssh host's key: the keys
	// the operator's known_hosts holds for it (authorized_keys format), or
	// SHA256 fingerprints checked out of band.
	HostKeys            []string `json:"host_keys,omitempty"`
	HostKeyFingerprints []string `json:"host_key_fingerprints,omitempty"`
	// Advertise is the node's mesh address, when not its ssh host.
	Advertise string `json:"advertise,omitempty"`
	// Image and Network of a docker node (defaults: the node image, the
	// engine's default bridge).
	Image   string `json:"image,omitempty"`
	Network string `json:"network,omitempty"`
	// Roles the node serves.
	Roles []NodeRole `json:"roles"`
	// Demo installs the demo model on the node as the upstream of every
	// role that names none.
	Demo bool `json:"demo,omitempty"`
	// AuthorityKey is the authority's private key (base64 seed, as the
	// key file holds it). It signs this node's admission certificate and
	// is forgotten when the add ends: never stored, never logged.
	AuthorityKey string `json:"authority_key"`
	// CertTTL is the certificate's validity in seconds (0: 720h).
	CertTTL float64 `json:"cert_ttl_seconds,omitempty"`
	// Verify commands must exit 0 on the host before anything is
	// installed.
	Verify []string `json:"verify,omitempty"`
	// JoinTimeout bounds the wait for the join, in seconds (0: 3m).
	JoinTimeout float64 `json:"join_timeout_seconds,omitempty"`
}

// NodeRole is one role a new node serves.
type NodeRole struct {
	Name string `json:"name"`
	// Upstream is the instance on the node (http://127.0.0.1:port); ""
	// with Demo set: the demo model.
	Upstream string `json:"upstream,omitempty"`
	Model    string `json:"model,omitempty"`
	// Port is the role's loopback port on the node (0: 18080, 18081, ...).
	Port int `json:"port,omitempty"`
}

// NodeEvent kinds.
const (
	NodeEventStage  = "stage"  // Phase and Stage say where the node is
	NodeEventLog    = "log"    // a line of the bootstrap log
	NodeEventDone   = "done"   // converged (add) or removed (remove)
	NodeEventFailed = "failed" // Stage failed; Message says why
)

// NodeEvent is one line of the add and remove streams (newline-delimited
// JSON).
type NodeEvent struct {
	Time    time.Time `json:"time"`
	Node    string    `json:"node"`
	Run     uint64    `json:"run,omitempty"`
	Kind    string    `json:"kind"`
	Phase   string    `json:"phase,omitempty"`
	Stage   string    `json:"stage,omitempty"`
	Message string    `json:"message,omitempty"`
	// Log lines: the stream and the sequence number shared by both
	// streams.
	Stream string `json:"stream,omitempty"`
	Seq    uint64 `json:"seq,omitempty"`
	Line   string `json:"line,omitempty"`
	// Attempt numbers a failed connect attempt that is made again (a
	// stage event of stage connecting; Message says why and when).
	Attempt int `json:"attempt,omitempty"`
}

// Terminal reports whether e ends a stream.
func (e NodeEvent) Terminal() bool { return e.Kind == NodeEventDone || e.Kind == NodeEventFailed }

// Node is one recorded node (GET /v0/nodes).
type Node struct {
	Name     string   `json:"name"`
	Provider string   `json:"provider"`
	Phase    string   `json:"phase"`
	Stage    string   `json:"stage,omitempty"`
	Lease    string   `json:"lease,omitempty"`
	Endpoint string   `json:"endpoint,omitempty"`
	Key      string   `json:"public_key,omitempty"`
	Roles    []string `json:"roles"`
	// Installed counts what the bootstrap put on the host.
	Installed int `json:"installed"`
	// Member: how the node is seen in this agent's mesh now ("admitted",
	// "not admitted: why", "not a member").
	Member  string    `json:"member,omitempty"`
	Failure string    `json:"failure,omitempty"`
	Busy    string    `json:"busy,omitempty"` // an add or remove in progress
	Run     uint64    `json:"run"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
	By      string    `json:"by,omitempty"`
}

// NodeList is GET /v0/nodes.
type NodeList struct {
	// BootstrapKey is the agent's SSH public key: authorize it on a host
	// (root's authorized_keys) before `node add --ssh`.
	BootstrapKey string `json:"bootstrap_key,omitempty"`
	Nodes        []Node `json:"nodes"`
}

// NodeFailedError is a stream that ended with a failed event.
type NodeFailedError struct {
	Node, Stage, Message string
}

func (e *NodeFailedError) Error() string {
	if e.Stage == "" {
		return e.Message
	}
	return fmt.Sprintf("failed at stage %s: %s", e.Stage, e.Message)
}

func (s *Server) nodeRoutes(mux *http.ServeMux) {
	b, ok := s.cfg.Backend.(NodeBackend)
	mux.HandleFunc("GET /v0/nodes", s.guard(false, func(w http.ResponseWriter, r *http.Request, _ Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "node bootstrap is not available"))
			return
		}
		reply(w, r, b.Nodes)
	}))
	mux.HandleFunc("POST /v0/nodes", s.guard(true, func(w http.ResponseWriter, r *http.Request, c Caller) {
		var req NodeAdd
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "node bootstrap is not available"))
			return
		}
		if decode(w, r, &req) {
			s.nodeStream(w, r, func(emit func(NodeEvent) error) error { return b.AddNode(r.Context(), c, req, emit) })
		}
	}))
	mux.HandleFunc("POST /v0/nodes/{name}/remove", s.guard(true, func(w http.ResponseWriter, r *http.Request, c Caller) {
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "node bootstrap is not available"))
			return
		}
		name := r.PathValue("name")
		s.nodeStream(w, r, func(emit func(NodeEvent) error) error { return b.RemoveNode(r.Context(), c, name, emit) })
	}))
}

// nodeStream answers with run's events as NDJSON. An error before the
// first event is an ordinary error answer; after it, a failed event ends
// the stream unless run sent its own terminal event.
func (s *Server) nodeStream(w http.ResponseWriter, r *http.Request, run func(emit func(NodeEvent) error) error) {
	rc := http.NewResponseController(w)
	enc := json.NewEncoder(w)
	started, ended := false, false
	emit := func(e NodeEvent) error {
		if !started {
			started = true
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.Header().Set("Cache-Control", "no-store")
			w.WriteHeader(http.StatusOK)
		}
		if e.Terminal() {
			ended = true
		}
		if err := enc.Encode(e); err != nil {
			return err
		}
		return rc.Flush()
	}
	err := run(emit)
	switch {
	case err != nil && !started:
		writeError(w, err)
	case err != nil && !ended:
		_ = emit(NodeEvent{Time: time.Now().UTC(), Kind: NodeEventFailed, Message: err.Error()})
	case err == nil && !started:
		_ = emit(NodeEvent{Time: time.Now().UTC(), Kind: NodeEventDone})
	}
}

// Nodes is GET /v0/nodes.
func (c *Client) Nodes(ctx context.Context) (NodeList, error) {
	return get[NodeList](ctx, c, "/v0/nodes")
}

// AddNode is POST /v0/nodes: fn sees every event; a failed node returns a
// *NodeFailedError.
func (c *Client) AddNode(ctx context.Context, req NodeAdd, fn func(NodeEvent) error) error {
	return c.nodeStream(ctx, "/v0/nodes", req, fn)
}

// RemoveNode is POST /v0/nodes/{name}/remove, streamed like AddNode.
func (c *Client) RemoveNode(ctx context.Context, name string, fn func(NodeEvent) error) error {
	return c.nodeStream(ctx, "/v0/nodes/"+url.PathEscape(name)+"/remove", struct{}{}, fn)
}

// PullInstance is POST /v0/instances/{role}/pull: fn sees each progress
// line (log events) and the end; an image that cannot be had returns a
// *NodeFailedError with the reason.
func (c *Client) PullInstance(ctx context.Context, role string, fn func(NodeEvent) error) error {
	return c.nodeStream(ctx, "/v0/instances/"+url.PathEscape(role)+"/pull", struct{}{}, fn)
}

// ErrStreamCut is returned when the agent's stream ends before a terminal
// event (the agent stopped or crashed).
var ErrStreamCut = errors.New("the agent ended the stream before the node was done (it stopped?)")

func (c *Client) nodeStream(ctx context.Context, path string, in any, fn func(NodeEvent) error) error {
	resp, err := c.open(ctx, http.MethodPost, path, in)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var end error
	terminal := false
	var fnErr error
	err = readLines(resp.Body, 2<<20, func(e NodeEvent) (bool, error) {
		if fnErr = fn(e); fnErr != nil {
			return true, fnErr
		}
		switch e.Kind {
		case NodeEventDone:
			terminal = true
		case NodeEventFailed:
			terminal, end = true, &NodeFailedError{Node: e.Node, Stage: e.Stage, Message: e.Message}
		}
		return terminal, nil
	})
	switch {
	case fnErr != nil:
		return fnErr
	case terminal:
		return end
	case ctx.Err() != nil:
		return ctx.Err()
	case err != nil:
		return fmt.Errorf("%w: %w", ErrStreamCut, err)
	}
	return ErrStreamCut
}
