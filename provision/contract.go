package provision

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ObservationKind says what a provider observed about an instance.
type ObservationKind uint8

// Observation kinds. A run of an instance (from start to end of its
// process) ends with exactly one ObsExited or ObsFailed.
const (
	ObsStdout ObservationKind = iota + 1 // a line the instance wrote to stdout
	ObsStderr                            // a line the instance wrote to stderr
	// ObsTelemetry is a telemetry frame (Channel, Payload). It is part of
	// the contract for runtimes that have structured frames to report; the
	// Docker provider produces none (see DockerProvider).
	ObsTelemetry
	ObsProvider // a line from the provider itself
	ObsExited   // the instance's process exited (Status; nil when unknown)
	// ObsFailed: the runtime failed or lost the instance for a reason it
	// can name (Reason): killed for running out of memory, or its resource
	// vanished. Status is set when the process has an exit status.
	ObsFailed
)

var obsNames = []string{"", "stdout", "stderr", "telemetry", "provider", "exited", "failed"}

func (k ObservationKind) String() string { return kindName(k, obsNames, "ObservationKind") }

// kindName is the name of k in names, or Type(k) for an unknown kind.
func kindName[K ~uint8](k K, names []string, typ string) string {
	if k != 0 && int(k) < len(names) {
		return names[k]
	}
	return fmt.Sprintf("%s(%d)", typ, k)
}

// Observation is one thing a provider saw about an instance. Which fields
// are set depends on Kind: Line for stdout/stderr/provider, Channel and
// Payload for telemetry, Status for exited, Reason (and Status when known)
// for failed.
type Observation struct {
	Kind       ObservationKind
	RunID      uint64
	InstanceID uint64
	Ref        string // provider ref of the instance
	Time       time.Time
	Line       string
	Channel    string
	Payload    string
	Status     *int
	Reason     string
}

// Sink receives observations. Providers call Observe from their own
// goroutines, possibly concurrently for different instances; Observe must
// be safe for concurrent use and must not block (buffer or drop).
type Sink interface {
	Observe(Observation)
}

// SinkFunc adapts a function to Sink.
type SinkFunc func(Observation)

// Observe calls f(o).
func (f SinkFunc) Observe(o Observation) { f(o) }

// Discard is a Sink that drops everything.
var Discard Sink = SinkFunc(func(Observation) {})

// EventKind is a lifecycle milestone of an instance.
type EventKind uint8

// Event kinds. Their names are the audit event kinds the agent records,
// prefixed "provision." (`infermesh events`).
const (
	EventProvisionStart  EventKind = iota + 1 // creating or adopting began
	EventInstanceLive                         // the instance answers its probe and is registered
	EventProvisionFailed                      // a step failed; Message says which and why
	EventInstanceStopped                      // the instance stopped (exited, failed or removed)
)

var eventNames = []string{"", "provision_start", "instance_live", "provision_failed", "instance_stopped"}

func (k EventKind) String() string { return kindName(k, eventNames, "EventKind") }

// Event is a lifecycle milestone, for operators and the audit trail.
type Event struct {
	Kind       EventKind
	RunID      uint64
	InstanceID uint64
	Role       string
	Ref        string
	Provider   string // e.g. "docker"
	Message    string
	Time       time.Time
}

// InstanceHandle addresses an instance attempt a provider created, adopted
// or prepared.
type InstanceHandle struct {
	InstanceID uint64
	RunID      uint64
	Ref        string // stable provider-side address (docker: container name)
	ResourceID string // provider resource id (docker: container id)
	ProcessID  uint32 // 0 when unknown
}

// AdoptedInstance is the result of a spec-addressed adoption.
type AdoptedInstance struct {
	Handle InstanceHandle
	// Ref is the stable provider-side address, for snapshot bookkeeping.
	Ref string
	// Running reports whether the resource was running when adopted.
	Running bool
}

// ErrOfferUnsupported is returned by CreateSelected when the provider
// cannot honour an exact offer selection. Providers never substitute.
var ErrOfferUnsupported = errors.New("provider does not support exact offer selection")

// ErrNotFound is returned when a handle's resource no longer exists.
var ErrNotFound = errors.New("provider resource not found")

// Provider acquires, adopts and releases the resources of concrete instance
// attempts: the runtime side of an instance (a container, a process). It
// has the calls the Manager makes; what only some providers can do is a
// small interface of its own (OfferSelector, RefLister, InstanceStopper,
// ImageEnsurer), found by a type assertion. A provider is safe for
// concurrent use across different instances; calls for the same instance
// are serialized by the caller. Methods do blocking I/O and honour ctx.
// Sinks passed in keep receiving observations for the instance until it is
// stopped or the provider is closed.
//
// An instance's life through a provider: CreateInstance (or AdoptBySpec,
// or PrepareBySpec after a crash), StartInstance, MarkLive once it
// answers; HaltInstance and StartInstance again to restart it in place;
// StopBySpec (or InstanceStopper's StopInstance) to release it.
type Provider interface {
	// CreateInstance acquires (or adopts an identical existing) resource
	// for spec, without starting it. Callers persist spec as durable intent
	// before calling.
	CreateInstance(ctx context.Context, spec ProvisionSpec, sink Sink) (InstanceHandle, error)
	// StartInstance starts (or resumes) the instance's process on its
	// created resource.
	StartInstance(ctx context.Context, h InstanceHandle) error
	// HaltInstance stops the instance's process, keeping its resource:
	// StartInstance starts it again.
	HaltInstance(ctx context.Context, h InstanceHandle) error
	// MarkLive tells the provider the instance is live: it answered its
	// readiness probe and serves.
	MarkLive(ctx context.Context, h InstanceHandle) error
	// AdoptBySpec finds the resource for spec and resumes observing it.
	// ok is false when nothing matching exists.
	AdoptBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (a AdoptedInstance, ok bool, err error)
	// PrepareBySpec recreates only the provider-local handle for a spec
	// whose intent was persisted before its resource was started. It must
	// never allocate or create a resource; ok is false when none exists.
	PrepareBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (a AdoptedInstance, ok bool, err error)
	// ProviderRef is the stable provider-side address for spec, derivable
	// without provider state.
	ProviderRef(spec ProvisionSpec) string
	// StopBySpec stops the resource addressed by spec. It returns false when
	// nothing matching exists: already stopped is success.
	StopBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (bool, error)
}

// OfferSelector is implemented by providers that can create an exact
// offer (a rented machine, say). Neither the Docker nor the native
// provider has offers: CreateSelected refuses any for them.
type OfferSelector interface {
	// CreateInstanceSelected creates exactly the selected offer, or fails
	// without substituting another. A nil offer means CreateInstance.
	CreateInstanceSelected(ctx context.Context, spec ProvisionSpec, sink Sink, offer *uint64) (InstanceHandle, error)
}

// CreateSelected creates the instance for spec on exactly the selected
// offer: through p's OfferSelector when it has one; otherwise a nil offer
// is CreateInstance and any other is ErrOfferUnsupported, naming the
// offer. A selected offer is authoritative: it is never substituted.
func CreateSelected(ctx context.Context, p Provider, spec ProvisionSpec, sink Sink, offer *uint64) (InstanceHandle, error) {
	if os, ok := p.(OfferSelector); ok {
		return os.CreateInstanceSelected(ctx, spec, sink, offer)
	}
	if offer != nil {
		return InstanceHandle{}, fmt.Errorf("%w %d", ErrOfferUnsupported, *offer)
	}
	return p.CreateInstance(ctx, spec, sink)
}

// RefLister is implemented by providers that can list the resources
// carrying this agent's ownership labels (orphan detection). The agent's
// sweep itself goes through the runtimes' cleanup backends (SiteCleanups).
type RefLister interface {
	ListManagedRefs(ctx context.Context) ([]string, error)
}

// ManagedRefs lists p's resources through its RefLister; a provider
// without a label sweep lists nothing (nil, nil).
func ManagedRefs(ctx context.Context, p Provider) ([]string, error) {
	if rl, ok := p.(RefLister); ok {
		return rl.ListManagedRefs(ctx)
	}
	return nil, nil
}

// InstanceStopper is implemented by providers that can release a resource
// by its handle. Already gone is success. The Manager stops by spec
// (StopBySpec), which needs no handle.
type InstanceStopper interface {
	StopInstance(ctx context.Context, h InstanceHandle) error
}

// ProviderDefaults carries the reference design's default behaviour for the
// optional parts of Provider. Embed it and override what the provider
// supports.
type ProviderDefaults struct{}

// HaltInstance does nothing.
func (ProviderDefaults) HaltInstance(context.Context, InstanceHandle) error { return nil }

// AdoptBySpec adopts nothing.
func (ProviderDefaults) AdoptBySpec(context.Context, ProvisionSpec, Sink) (AdoptedInstance, bool, error) {
	return AdoptedInstance{}, false, nil
}

// PrepareBySpec prepares nothing.
func (ProviderDefaults) PrepareBySpec(context.Context, ProvisionSpec, Sink) (AdoptedInstance, bool, error) {
	return AdoptedInstance{}, false, nil
}

// ProviderRef returns "instance-<run>-<instance>".
func (ProviderDefaults) ProviderRef(spec ProvisionSpec) string {
	return fmt.Sprintf("instance-%d-%d", spec.RunID, spec.InstanceID)
}

// StopBySpec finds nothing.
func (ProviderDefaults) StopBySpec(context.Context, ProvisionSpec, Sink) (bool, error) {
	return false, nil
}
