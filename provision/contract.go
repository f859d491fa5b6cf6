package provision

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ObservationKind says what a provider observed about a node.
type ObservationKind uint8

// Observation kinds.
const (
	ObsStdout    ObservationKind = iota + 1 // a line the node wrote to stdout
	ObsStderr                               // a line the node wrote to stderr
	ObsTelemetry                            // a telemetry frame (Channel, Payload)
	ObsProvider                             // a line from the provider itself
	ObsExited                               // the node's process exited (Status)
	ObsFailed                               // the provider lost or failed the node (Reason)
)

var obsNames = [...]string{"", "stdout", "stderr", "telemetry", "provider", "exited", "failed"}

func (k ObservationKind) String() string {
	if int(k) < len(obsNames) && k != 0 {
		return obsNames[k]
	}
	return fmt.Sprintf("ObservationKind(%d)", k)
}

// Observation is one thing a provider saw about a node. Which fields are
// set depends on Kind: Line for stdout/stderr/provider, Channel and Payload
// for telemetry, Status for exited (nil when unknown), Reason for failed.
type Observation struct {
	Kind    ObservationKind
	RunID   uint64
	NodeID  uint64
	Ref     string // provider ref of the node
	Time    time.Time
	Line    string
	Channel string
	Payload string
	Status  *int
	Reason  string
}

// Sink receives observations. Providers call Observe from their own
// goroutines, possibly concurrently for different nodes; Observe must be
// safe for concurrent use and must not block (buffer or drop).
type Sink interface {
	Observe(Observation)
}

// SinkFunc adapts a function to Sink.
type SinkFunc func(Observation)

// Observe calls f(o).
func (f SinkFunc) Observe(o Observation) { f(o) }

// Discard is a Sink that drops everything.
var Discard Sink = SinkFunc(func(Observation) {})

// EventKind is a lifecycle milestone of a node or instance.
type EventKind uint8

// Event kinds.
const (
	EventProvisionStart  EventKind = iota + 1 // creating or adopting began
	EventNodeLive                             // the node is up (instance: ready and registered)
	EventProvisionFailed                      // a step failed; Message says which and why
	EventNodeStopped                          // the node stopped (exited or removed)
)

var eventNames = [...]string{"", "provision_start", "node_live", "provision_failed", "node_stopped"}

func (k EventKind) String() string {
	if int(k) < len(eventNames) && k != 0 {
		return eventNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", k)
}

// Event is a lifecycle milestone, for operators and the audit trail.
type Event struct {
	Kind     EventKind
	RunID    uint64
	NodeID   uint64
	Role     string
	Ref      string
	Provider string // e.g. "docker"
	Message  string
	Time     time.Time
}

// NodeHandle addresses a node a provider created or adopted.
type NodeHandle struct {
	NodeID     uint64
	RunID      uint64
	Ref        string // stable provider-side address (docker: container name)
	ResourceID string // provider resource id (docker: container id)
	ProcessID  uint32 // 0 when unknown
}

// AdoptedNode is the result of a spec-addressed adoption.
type AdoptedNode struct {
	Handle NodeHandle
	// Ref is the stable provider-side address, for snapshot bookkeeping.
	Ref string
	// Running reports whether the resource was running when adopted.
	Running bool
}

// ErrOfferUnsupported is returned by CreateNodeSelected when the provider
// cannot honour an exact offer selection. Providers never substitute.
var ErrOfferUnsupported = errors.New("provider does not support exact offer selection")

// ErrNotFound is returned when a handle's resource no longer exists.
var ErrNotFound = errors.New("provider resource not found")

// Provider acquires, adopts and releases provider resources for concrete
// node attempts. A provider is safe for concurrent use across different
// nodes; calls for the same node are serialized by the caller. Methods do
// blocking I/O and honour ctx. Sinks passed in keep receiving observations
// for the node until it is stopped or the provider is closed.
type Provider interface {
	// CreateNode acquires (or adopts an identical existing) resource for
	// spec. Callers persist spec as durable intent before calling.
	CreateNode(ctx context.Context, spec NodeSpec, sink Sink) (NodeHandle, error)
	// CreateNodeSelected creates exactly the selected offer, or fails
	// (ErrOfferUnsupported) without substituting another. A nil offer
	// means CreateNode.
	CreateNodeSelected(ctx context.Context, spec NodeSpec, sink Sink, offer *uint64) (NodeHandle, error)
	// StartBootstrap starts (or resumes) bootstrap work on a created resource.
	StartBootstrap(ctx context.Context, h NodeHandle) error
	// CancelBootstrap stops bootstrap work in progress, keeping the resource.
	CancelBootstrap(ctx context.Context, h NodeHandle) error
	// CompleteBootstrap marks bootstrap done (the node is live).
	CompleteBootstrap(ctx context.Context, h NodeHandle) error
	// StopNode stops and releases the resource. Already gone is success.
	StopNode(ctx context.Context, h NodeHandle) error
	// AdoptBySpec finds the resource for spec and resumes observing it.
	// ok is false when nothing matching exists.
	AdoptBySpec(ctx context.Context, spec NodeSpec, sink Sink) (a AdoptedNode, ok bool, err error)
	// PrepareMissingBootstrap recreates only the provider-local handle for a
	// spec whose intent was persisted before its resource was started. It
	// must never allocate or create a resource; ok is false when none exists.
	PrepareMissingBootstrap(ctx context.Context, spec NodeSpec, sink Sink) (a AdoptedNode, ok bool, err error)
	// ProviderRef is the stable provider-side address for spec, derivable
	// without provider state.
	ProviderRef(spec NodeSpec) string
	// ListManagedRefs lists resources carrying this agent's ownership labels
	// (orphan detection). Providers without a label sweep return nil.
	ListManagedRefs(ctx context.Context) ([]string, error)
	// StopBySpec stops the resource addressed by spec. It returns false when
	// nothing matching exists: already stopped is success.
	StopBySpec(ctx context.Context, spec NodeSpec, sink Sink) (bool, error)
}

// ProviderDefaults carries the reference design's default behaviour for the
// optional parts of Provider. Embed it and override what the provider
// supports.
type ProviderDefaults struct{}

// CreateNodeSelectedDefault implements the default of CreateNodeSelected for
// providers that embed ProviderDefaults: any exact offer is refused.
func CreateNodeSelectedDefault(ctx context.Context, p Provider, spec NodeSpec, sink Sink, offer *uint64) (NodeHandle, error) {
	if offer != nil {
		return NodeHandle{}, fmt.Errorf("%w %d", ErrOfferUnsupported, *offer)
	}
	return p.CreateNode(ctx, spec, sink)
}

// CancelBootstrap does nothing.
func (ProviderDefaults) CancelBootstrap(context.Context, NodeHandle) error { return nil }

// AdoptBySpec adopts nothing.
func (ProviderDefaults) AdoptBySpec(context.Context, NodeSpec, Sink) (AdoptedNode, bool, error) {
	return AdoptedNode{}, false, nil
}

// PrepareMissingBootstrap prepares nothing.
func (ProviderDefaults) PrepareMissingBootstrap(context.Context, NodeSpec, Sink) (AdoptedNode, bool, error) {
	return AdoptedNode{}, false, nil
}

// ProviderRef returns "node-<run>-<node>".
func (ProviderDefaults) ProviderRef(spec NodeSpec) string {
	return fmt.Sprintf("node-%d-%d", spec.RunID, spec.NodeID)
}

// ListManagedRefs lists nothing: no label sweep.
func (ProviderDefaults) ListManagedRefs(context.Context) ([]string, error) { return nil, nil }

// StopBySpec finds nothing.
func (ProviderDefaults) StopBySpec(context.Context, NodeSpec, Sink) (bool, error) { return false, nil }
