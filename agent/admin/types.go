package admin

import (
	"fmt"
	"time"
)

// The JSON shapes of the v0 API. They are also what `infermesh --json`
// prints, so changing a name is a breaking change for scripts.

// Status is GET /v0/status.
type Status struct {
	Node          string       `json:"node"`
	Version       string       `json:"version"`
	Started       time.Time    `json:"started"`
	UptimeSeconds float64      `json:"uptime_seconds"`
	Config        string       `json:"config,omitempty"` // the config file, "" when built in (dev mode)
	Generation    uint64       `json:"generation"`       // the placement table's
	Mesh          MeshStatus   `json:"mesh"`
	LocalRoles    []string     `json:"local_roles"`  // roles served by a local instance now
	RemoteRoles   []RemoteRole `json:"remote_roles"` // roles peers serve to us now
	Overrides     int          `json:"overrides"`    // run-time policy overrides in force
}

// MeshStatus summarizes this node's mesh membership.
type MeshStatus struct {
	// State is "disabled" (no mesh configured), "alone" (no peers) or
	// "joined".
	State      string `json:"state"`
	GossipAddr string `json:"gossip_addr,omitempty"`
	Members    int    `json:"members"`  // live members, this node included
	Admitted   int    `json:"admitted"` // of which admitted now
}

// RemoteRole is a role and the peers that are candidates for it now, in
// the order the proxy tries them.
type RemoteRole struct {
	Role  string   `json:"role"`
	Nodes []string `json:"nodes"`
}

// Peer states.
const (
	PeerSelf        = "self"
	PeerAdmitted    = "admitted"
	PeerNotAdmitted = "not_admitted"
	// PeerRefused: a node refused membership (wrong key, revoked, expired,
	// not trusted); never a member, shown so the operator sees it.
	PeerRefused = "refused"
)

// Peer is one mesh member (GET /v0/peers).
type Peer struct {
	Name       string   `json:"name"`
	State      string   `json:"state"` // self, admitted, not_admitted, refused
	Scope      string   `json:"scope,omitempty"`
	Why        string   `json:"why,omitempty"` // why not admitted
	GossipAddr string   `json:"gossip_addr,omitempty"`
	QUICAddr   string   `json:"quic_addr,omitempty"`
	PublicKey  string   `json:"public_key,omitempty"`
	Roles      []string `json:"roles"` // roles it advertises that we hold, fresh or not
	// LastSeen is when a refused node last tried to join (state refused).
	LastSeen *time.Time `json:"last_seen,omitempty"`
}

// Rule sources.
const (
	SourceConfig  = "config"
	SourceRuntime = "runtime"
	SourceDefault = "default" // nothing says otherwise: default deny
	// SourceAuthority: a statement signed by the cluster authority.
	SourceAuthority = "authority"
)

// Rule is one policy fact and where it came from.
type Rule struct {
	Node   string     `json:"node,omitempty"`
	On     bool       `json:"on"`
	Source string     `json:"source"` // config, runtime or default
	By     string     `json:"by,omitempty"`
	At     *time.Time `json:"at,omitempty"`
}

// Role is one role's configuration and state (GET /v0/roles).
type Role struct {
	Name       string       `json:"name"`
	Configured bool         `json:"configured"` // in the config file (else only run-time overrides or adverts)
	Addr       string       `json:"addr,omitempty"`
	Local      *LocalTarget `json:"local,omitempty"`
	Expose     Rule         `json:"expose"`
	ServeTo    []Rule       `json:"serve_to"`    // peers we serve the role to; runtime "off" rules included
	AcceptFrom []Rule       `json:"accept_from"` // nodes that may serve it to us; runtime "off" rules included
	Remotes    []RemoteAd   `json:"remotes"`
}

// LocalTarget is a local instance.
type LocalTarget struct {
	Base    string `json:"base"`
	Model   string `json:"model,omitempty"`
	Runtime string `json:"runtime,omitempty"`
}

// RemoteAd is a peer's advert held for a role.
type RemoteAd struct {
	Node       string  `json:"node"`
	Model      string  `json:"model,omitempty"`
	Load       uint32  `json:"load"`
	AgeSeconds float64 `json:"age_seconds"`
	Fresh      bool    `json:"fresh"`
}

// Route is GET /v0/route/{role}: who serves the role now and why every
// other node does not.
type Route struct {
	Role       string `json:"role"`
	Generation uint64 `json:"generation"`
	Serving    string `json:"serving,omitempty"` // the first candidate's node, "" when none
	// Queue is how many of the role's requests wait at this agent for a
	// free slot (routing.queue).
	Queue int `json:"queue"`
	// CacheHitRatio is the local instance's prefix cache hit ratio over
	// recent minutes, from its metrics (vLLM's prefix cache counters);
	// absent when they say none.
	CacheHitRatio *float64   `json:"cache_hit_ratio,omitempty"`
	Decisions     []Decision `json:"decisions"`
	// Hints name roles peers advertise under a name close to Role (a
	// typo on one side), when no peer advertises Role itself.
	Hints []string `json:"hints,omitempty"`
}

// Decision is one node's verdict for a role.
type Decision struct {
	Node       string   `json:"node"`
	Kind       string   `json:"kind"` // local or remote
	Candidate  bool     `json:"candidate"`
	Rank       int      `json:"rank"`              // position among candidates, -1 when not one
	Reasons    []string `json:"reasons,omitempty"` // why not a candidate
	Notes      []string `json:"notes,omitempty"`   // about a candidate: cooled down, busy, failing
	Model      string   `json:"model,omitempty"`
	Load       uint32   `json:"load"`
	HasAdvert  bool     `json:"has_advert,omitempty"`
	AgeSeconds float64  `json:"age_seconds,omitempty"`
	// Capacity is the instance's, as it reports it (nil: unknown).
	Capacity *Capacity `json:"capacity,omitempty"`
}

// Capacity is an instance's capacity and use, as its engine's metrics
// (llama.cpp, vLLM) or the role's capacity say.
type Capacity struct {
	Slots   uint32  `json:"slots"` // requests it runs at once; 0 unknown
	Running uint32  `json:"running"`
	Waiting uint32  `json:"waiting"`  // queued at the instance
	KVUsage float32 `json:"kv_usage"` // share of its KV cache in use, 0 to 1
	// CacheHitRatio is the instance's prefix cache hit ratio over recent
	// minutes, as its node measures it (vLLM's counters), in hundredths;
	// absent when its engine counts none.
	CacheHitRatio *float64 `json:"cache_hit_ratio,omitempty"`
}

// Policy kinds, as in the config file (roles.<r>.accept_from, ...).
const (
	KindAcceptFrom = "accept_from"
	KindServeTo    = "serve_to"
	KindExpose     = "expose"
	KindRevoke     = "revoke"
	// KindSignedRevoke is an override the agent records for a statement
	// signed by the authority (listed by Policy, never set directly: send
	// KindRevoke with a Statement).
	KindSignedRevoke = "signed_revoke"
)

// PolicyChange is POST /v0/policy. Revoke with On false lifts a run-time
// revocation.
type PolicyChange struct {
	Kind string `json:"kind"`
	Role string `json:"role,omitempty"`
	Node string `json:"node,omitempty"`
	On   bool   `json:"on"`
	// Statement, with KindRevoke, is a revocation (On) or its lifting
	// (off) signed by the cluster authority (identity.Revocation's text
	// form) about Node: every node takes it and spreads it. Without it a
	// revocation is this node's alone.
	Statement string `json:"statement,omitempty"`
}

// Override is a stored run-time policy change.
type Override struct {
	Kind string    `json:"kind"`
	Role string    `json:"role,omitempty"`
	Node string    `json:"node,omitempty"`
	On   bool      `json:"on"`
	At   time.Time `json:"at"`
	By   string    `json:"by,omitempty"`
	// Active is false when the override names a role the config no longer
	// has: it is kept, and applies again if the role comes back. A
	// signed revocation is inactive when no configured authority signed it.
	Active bool `json:"active"`
	// Statement is a signed revocation's statement (KindSignedRevoke).
	Statement string `json:"statement,omitempty"`
}

// PolicyResult answers a PolicyChange.
type PolicyResult struct {
	Override Override `json:"override"`
	// Changed reports whether what the agent enforces changed.
	Changed bool   `json:"changed"`
	Note    string `json:"note,omitempty"`
}

// PolicyFilter selects overrides to reset (POST /v0/policy/reset); empty
// fields match everything.
type PolicyFilter struct {
	Kind string `json:"kind,omitempty"`
	Role string `json:"role,omitempty"`
	Node string `json:"node,omitempty"`
}

// ResetResult answers a reset: the overrides dropped.
type ResetResult struct {
	Removed []Override `json:"removed"`
}

// Keyring is GET /v0/keyring.
type Keyring struct {
	Members int         `json:"members"` // live mesh members, this node included
	Keys    []GossipKey `json:"keys"`    // primary first
	// Note says how a cluster-wide change went (keyring rotate).
	Note string `json:"note,omitempty"`
}

// GossipKey is one gossip key and how many members hold it. Key is the
// secret itself: empty unless asked for (Client.KeyringSecrets), and then
// sent only to callers that may change things.
type GossipKey struct {
	Key         string `json:"key,omitempty"`
	Fingerprint string `json:"fingerprint"`
	Primary     bool   `json:"primary"`
	Nodes       int    `json:"nodes"`
}

// Keyring operations.
const (
	KeyringInstall = "install"
	KeyringUse     = "use"
	KeyringRemove  = "remove"
	// KeyringRotate makes a new key the only one on this node and every
	// admitted peer (sent over QUIC); no key is given.
	KeyringRotate = "rotate"
)

// KeyringChange is POST /v0/keyring/{op}.
type KeyringChange struct {
	Op  string `json:"op"`
	Key string `json:"key"`
}

// Event is one audit event of GET /v0/events (newline-delimited JSON).
type Event struct {
	Time   time.Time         `json:"time"`
	Kind   string            `json:"kind"`
	Role   string            `json:"role,omitempty"`
	Node   string            `json:"node,omitempty"`
	Fields map[string]string `json:"fields,omitempty"`
}

// EventsOptions select what GET /v0/events sends: the recent history (the
// last Last events when Last > 0, ?last=N), then new events while Follow
// (?follow=false ends the stream after the history).
type EventsOptions struct {
	Follow bool
	Last   int
}

// ReloadResult is POST /v0/reload.
type ReloadResult struct {
	Config       string   `json:"config"`
	Applied      []string `json:"applied"`       // changes in force now
	NeedsRestart []string `json:"needs_restart"` // changes read but applied only at the next start
	Generation   uint64   `json:"generation"`
}

// Instance is a managed local instance (GET /v0/instances).
type Instance struct {
	Role        string    `json:"role"`
	State       string    `json:"state"`
	Runtime     string    `json:"runtime,omitempty"` // docker, native
	Ref         string    `json:"ref,omitempty"`
	ContainerID string    `json:"container_id,omitempty"`
	PID         int       `json:"pid,omitempty"` // a native instance's process
	Endpoint    string    `json:"endpoint,omitempty"`
	Image       string    `json:"image,omitempty"` // image, or a native instance's command
	Restarts    int       `json:"restarts"`
	LastError   string    `json:"last_error,omitempty"`
	Since       time.Time `json:"since"`
}

// LogLine is one line of an instance's log (GET /v0/instances/{role}/logs).
type LogLine struct {
	Time   time.Time `json:"time"`
	Stream string    `json:"stream"`
	Line   string    `json:"line"`
}

// Caller is who is on the other end of an admin connection, from the
// kernel (SO_PEERCRED).
type Caller struct {
	UID   uint32 `json:"uid"`
	GID   uint32 `json:"gid"`
	PID   int32  `json:"pid"`
	Write bool   `json:"write"` // may change things
}

// String names the caller for audit records: "uid 1000 (alice) pid 42".
func (c Caller) String() string {
	if name := userName(c.UID); name != "" {
		return fmt.Sprintf("uid %d (%s) pid %d", c.UID, name, c.PID)
	}
	return fmt.Sprintf("uid %d pid %d", c.UID, c.PID)
}

// RecentRequest is one finished request, as GET /v0/requests and the
// console list them.
type RecentRequest struct {
	Time   time.Time `json:"time"` // when it finished
	ID     string    `json:"id"`   // X-Request-Id
	Role   string    `json:"role"`
	Source string    `json:"source"` // app (this host) or peer (served here for a peer)
	// Target answered it: local, a peer node, or "" when none did.
	Target         string  `json:"target"`
	Status         int     `json:"status"`
	DurationMillis float64 `json:"duration_ms"`
	TTFTMillis     float64 `json:"ttft_ms,omitempty"` // first SSE event; 0 when not a stream
	// Attempts is how many candidates were sent it (more than 1: it
	// failed over).
	Attempts         int   `json:"attempts"`
	Aborted          bool  `json:"aborted,omitempty"`
	PromptTokens     int64 `json:"prompt_tokens,omitempty"`
	CompletionTokens int64 `json:"completion_tokens,omitempty"`
	// Route is how its candidate was chosen; nil when there was one
	// candidate only (or it came from a peer).
	Route *RouteDecision `json:"route,omitempty"`
}
