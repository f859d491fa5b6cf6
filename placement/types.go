package placement

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// ServicePrefix prefixes the advertised service name of a role.
const ServicePrefix = "infer."

// DefaultAdvertTTL is how long a received advertisement counts without
// being refreshed by a repeat.
const DefaultAdvertTTL = 60 * time.Second

// Admission tells the table which nodes are trusted right now. The mesh
// satisfies it.
//
// Methods must be safe for concurrent use and must not block or call back
// into the Table: they are called on every Resolve and every ingested
// advertisement (never while the table's lock is held).
type Admission interface {
	// IsAdmitted reports whether node is trusted now (any scope), not
	// revoked and not expired.
	IsAdmitted(node string) bool
	// MayServe reports whether node is admitted with scope "full", i.e.
	// may serve roles to other nodes.
	MayServe(node string) bool
	// Trusted reports whether node is trusted now (any scope), not revoked
	// and not expired, even when it is not a live member right now: what
	// CheckPeer asks of a peer whose authenticated connection proved who
	// it is (a restarting peer asks before gossip lists it alive again).
	Trusted(node string) bool
}

// AuditSink records policy changes and refusals.
//
// Audit must be safe for concurrent use and must not block. The table calls
// it outside its lock, after the change it describes took effect; events of
// concurrent calls may therefore arrive in either order.
type AuditSink interface {
	Audit(e AuditEvent)
}

// Audit event kinds.
const (
	// AuditRemoteAllow: consumer-side allowlist changed (AllowRemoteNode).
	AuditRemoteAllow = "infer.remote.allow"
	// AuditMeshAllow: serving-side allowlist changed (AllowMeshPeer).
	AuditMeshAllow = "infer.mesh.allow"
	// AuditMeshExpose: a role's exposure changed (ExposeToMesh).
	AuditMeshExpose = "infer.mesh.expose"
	// AuditAdvertRefused: an advertisement was not heard.
	AuditAdvertRefused = "infer.advert.refused"
	// AuditPeerRefused: a peer's request was refused a local instance
	// (LocalForPeer / CheckPeer).
	AuditPeerRefused = "infer.peer.refused"
	// AuditPolicyRefused: a policy call was ignored (bad role or node).
	AuditPolicyRefused = "infer.policy.refused"
)

// AuditEvent is one audited change or refusal.
type AuditEvent struct {
	Kind   string            // one of the Audit* kinds
	Role   string            // role concerned
	Node   string            // the other node concerned (peer/sender), "" if none
	Fields map[string]string // extra, e.g. "allowed":"true", "why":"..."
}

// Reason says why a node is not a candidate or why something was refused.
type Reason string

// Reasons. They are stable strings, fit for logs and the CLI.
const (
	ReasonBadName        Reason = "name lacks the infer. prefix"
	ReasonBadRole        Reason = "invalid role"
	ReasonBadSender      Reason = "empty sender"
	ReasonFromSelf       Reason = "advertisement from this node"
	ReasonNotOwnAdvert   Reason = "advertisement is for another node"
	ReasonNoMesh         Reason = "no mesh (no admission configured)"
	ReasonNotAdmitted    Reason = "node not admitted"
	ReasonMayNotServe    Reason = "node not admitted with scope full"
	ReasonNotAllowlisted Reason = "node not allowlisted for role"
	ReasonStale          Reason = "advertisement expired"
	ReasonNoAdvert       Reason = "no advertisement received"
	ReasonNotExposed     Reason = "role not exposed to the mesh"
	ReasonNotOnServeList Reason = "peer not on the role's serve list"
	ReasonNoLocal        Reason = "role not served locally"
	ReasonEmptyNode      Reason = "empty node id"
	ReasonSelfNotPeer    Reason = "this node is not a peer of itself"
)

// ErrRefused is wrapped by every *RefusedError.
var ErrRefused = errors.New("refused")

// RefusedError is returned when an advertisement is not heard, or a peer is
// refused a local instance. errors.Is(err, ErrRefused) holds.
type RefusedError struct {
	Reason Reason
	Role   string // role concerned, as far as it could be read
	Node   string // sender or peer
}

// Error says what was refused and why.
func (e *RefusedError) Error() string {
	return fmt.Sprintf("refused role %q from node %q: %s", e.Role, e.Node, e.Reason)
}

// Unwrap makes errors.Is(err, ErrRefused) hold.
func (e *RefusedError) Unwrap() error { return ErrRefused }

// Config configures a Table. The zero value of every field but NodeID
// means its default.
type Config struct {
	// NodeID is this node's id. Required.
	NodeID string
	// Admission decides which nodes are trusted. Nil means no mesh: only
	// local instances resolve and every advertisement is refused.
	Admission Admission
	// Audit receives audited changes and refusals. Nil discards them.
	Audit AuditSink
	// AdvertTTL is how long a received advertisement counts, measured
	// from our receipt of it. 0 means DefaultAdvertTTL; negative is an error.
	AdvertTTL time.Duration
	// Now is the clock. Nil means time.Now; tests inject a fake clock.
	Now func() time.Time
}

// DefaultConfig returns the defaults for everything but NodeID.
func DefaultConfig() Config {
	return Config{AdvertTTL: DefaultAdvertTTL, Now: time.Now}
}

// Local is a local instance serving a role.
type Local struct {
	Base    string // http://<loopback host>:<port>, canonical, no trailing '/'
	Model   string // model the instance knows; "" = pass through
	API     string // e.g. "openai"
	Runtime string // e.g. "llama.cpp", "demo", "docker"
}

// Advert is an infer.<role> advertisement: a node announcing it serves a role.
type Advert struct {
	Name    string // "infer.<role>"
	Node    string // originating node id
	API     string
	Runtime string
	Model   string
	Load    uint32 // in-flight requests (or similar) at the origin, lower = better
	Methods []string
	// Capacity is what the origin's instance reports of its slots, queue
	// and cache (the zero value: unknown).
	Capacity Capacity
}

// Capacity is an instance's capacity and use, as its engine reports it
// (llama.cpp's or vLLM's metrics) or its config states: how many requests
// it runs at once (Slots; 0: unknown), how many it runs now and how many
// wait for a slot, the share of its KV cache in use (0 to 1), and the
// tokens its KV cache holds (CacheTokens; 0: unknown), which bounds the
// prefixes it can keep, and the share of its recent prompt tokens its
// prefix cache held (CacheHit, 0 to 1, in hundredths; only when HasCacheHit:
// vLLM counts it, llama.cpp does not).
type Capacity struct {
	Slots, Running, Waiting uint32
	KVUsage                 float32
	CacheTokens             uint32
	CacheHit                float32
	HasCacheHit             bool
}

// CacheHitRatio is CacheHit as a float64 in hundredths (a float32's
// 0.73 read back as 0.73, not 0.7300000190734863); false unless
// HasCacheHit.
func (c Capacity) CacheHitRatio() (float64, bool) {
	return math.Round(float64(c.CacheHit)*100) / 100, c.HasCacheHit
}

// RoundCacheHit is a cache hit ratio as capacities carry it: in hundredths,
// clamped to 0..1 (NaN is 0), so that a ratio that drifts in its third
// digit does not read as a change of load.
func RoundCacheHit(r float64) float32 {
	if !(r > 0) {
		return 0
	}
	return float32(math.Round(min(r, 1)*100) / 100)
}

// Known reports whether anything is known of the capacity.
func (c Capacity) Known() bool { return c != Capacity{} }

// Role is the role of the advertisement's name, "" when the name lacks
// ServicePrefix. The role is not validated.
func (a Advert) Role() string {
	r, ok := strings.CutPrefix(a.Name, ServicePrefix)
	if !ok {
		return ""
	}
	return r
}

func (a Advert) clone() Advert {
	a.Methods = append([]string(nil), a.Methods...)
	return a
}

// sameContent reports whether a and b say the same thing; a difference is a
// real change (it changes what Resolve or the proxy does).
func (a Advert) sameContent(b Advert) bool {
	if a.Name != b.Name || a.Node != b.Node || a.API != b.API || a.Runtime != b.Runtime ||
		a.Model != b.Model || a.Load != b.Load || a.Capacity != b.Capacity || len(a.Methods) != len(b.Methods) {
		return false
	}
	for i := range a.Methods {
		if a.Methods[i] != b.Methods[i] {
			return false
		}
	}
	return true
}

// AdvertMethods returns the API methods our advertisements carry.
func AdvertMethods() []string {
	return []string{"chat.completions", "completions", "embeddings", "models"}
}

// Kind says where a candidate runs.
type Kind uint8

// Candidate kinds. The zero Kind is invalid.
const (
	KindLocal Kind = iota + 1
	KindRemote
)

func (k Kind) String() string {
	switch k {
	case KindLocal:
		return "local"
	case KindRemote:
		return "remote"
	default:
		return fmt.Sprintf("Kind(%d)", uint8(k))
	}
}

// Candidate is one place a role can be served, as returned by Resolve.
type Candidate struct {
	Kind  Kind
	Node  string // this node for local
	Base  string // local only
	Model string
	Load  uint32 // remote only
	// Capacity is the instance's capacity and use: the advert's (remote),
	// SetLocalCapacity's (local).
	Capacity Capacity
	// LoadSeq (remote only) changes whenever Load and Capacity do: an
	// advert that says something new, or a load report (ReportLoad). A
	// consumer that adds what it sent since to a peer's load notes what it
	// had in flight at a LoadSeq, and starts again when LoadSeq moves.
	LoadSeq uint64
}

// Decision is Explain's verdict on one node for a role.
type Decision struct {
	Node      string
	Kind      Kind
	Candidate bool          // whether Resolve returns it
	Rank      int           // position in Resolve's list, -1 when not a candidate
	Reasons   []Reason      // why not a candidate; empty when it is
	Base      string        // local only
	Model     string        // from the local entry or the advert
	Load      uint32        // remote: advertised load; local: SetLocalLoad value
	HasAdvert bool          // remote: an advert was received (fresh or not)
	Age       time.Duration // remote with advert: time since our receipt
	Capacity  Capacity      // remote: advertised; local: SetLocalCapacity value
}

// RemoteEntry is a received advertisement as Snapshot shows it.
type RemoteEntry struct {
	Role       string
	Node       string
	Advert     Advert
	ReceivedAt time.Time     // our receipt time of the latest copy
	Age        time.Duration // now - ReceivedAt
	Fresh      bool          // Age <= AdvertTTL
}

// Snapshot is a deep copy of the table's state, for status output.
type Snapshot struct {
	NodeID     string
	Generation uint64
	AdvertTTL  time.Duration
	Locals     map[string]Local    // role -> local instance
	LocalLoad  map[string]uint32   // role -> load carried in our adverts
	LocalCap   map[string]Capacity // role -> capacity carried in our adverts
	Remotes    []RemoteEntry       // sorted by role, then node
	Allow      map[string][]string // consumer side: role -> nodes allowed to serve it to us (sorted)
	Serve      map[string][]string // serving side: role -> peers we serve it to (sorted)
	Exposed    []string            // roles exposed to the mesh (sorted)
	ProxyPorts map[string]uint16   // role -> loopback proxy port
}
