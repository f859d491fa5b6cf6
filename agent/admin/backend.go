package admin

import (
	"context"
	"errors"
	"fmt"
)

// Backend is what the admin API needs of the agent. *agent.Backend is the
// real one; tests use fakes.
//
// Every method may be called concurrently from request goroutines and must
// be safe for concurrent use. Methods may block briefly (a store write, a
// keyring change spreading) and must return when ctx ends. Events blocks
// for the whole stream. Errors that wrap ErrInvalid, ErrNotFound,
// ErrConflict or ErrNotConfigured reach the client with their meaning
// (400, 404, 409, 503); any other error is a 500.
//
// The caller (by) of a change is the kernel-verified peer of the
// connection; the server has already checked that it may write.
type Backend interface {
	Status(ctx context.Context) (Status, error)
	Peers(ctx context.Context) ([]Peer, error)
	Roles(ctx context.Context) ([]Role, error)
	// Route explains role's placement (placement.Table.Explain).
	Route(ctx context.Context, role string) (Route, error)

	// Policy lists the run-time overrides.
	Policy(ctx context.Context) ([]Override, error)
	// SetPolicy records a run-time override and applies it.
	SetPolicy(ctx context.Context, by Caller, c PolicyChange) (PolicyResult, error)
	// ResetPolicy drops the overrides f matches; the config applies again.
	ResetPolicy(ctx context.Context, by Caller, f PolicyFilter) (ResetResult, error)

	// Keyring lists the gossip keys; ErrNotConfigured without a mesh.
	Keyring(ctx context.Context) (Keyring, error)
	// ChangeKeyring installs, uses or removes a gossip key across the
	// cluster and returns the keyring after the change.
	ChangeKeyring(ctx context.Context, by Caller, c KeyringChange) (Keyring, error)

	// Events calls fn with the recent audit history (its last o.Last
	// events when o.Last > 0), then, with o.Follow, with every new event,
	// until ctx ends (nil) or fn returns an error (that error). Without
	// o.Follow it returns after the history.
	Events(ctx context.Context, o EventsOptions, fn func(Event) error) error

	// Reload re-reads the config file and applies what can change at run
	// time.
	Reload(ctx context.Context, by Caller) (ReloadResult, error)

	// Instances lists managed instances; ErrNotConfigured without
	// provisioning.
	Instances(ctx context.Context) ([]Instance, error)
	// InstanceLogs returns up to n recent log lines of role's instance
	// (n < 1: all kept).
	InstanceLogs(ctx context.Context, role string, n int) ([]LogLine, error)
	// RetryInstance starts role's given-up instance again under a fresh
	// restart policy; ErrNotFound without one, ErrConflict when it has not
	// failed.
	RetryInstance(ctx context.Context, by Caller, role string) (Instance, error)
	// StopInstance stops role's instance and keeps it stopped until
	// RetryInstance; ErrNotFound without one.
	StopInstance(ctx context.Context, by Caller, role string) (Instance, error)
}

// PullBackend is a Backend that can fetch a managed instance's image.
type PullBackend interface {
	// PullInstance makes role's instance image present on the host,
	// pulling it when missing and calling progress with each line to
	// report; ErrNotFound without a docker instance for role or when the
	// image cannot be pulled.
	PullInstance(ctx context.Context, by Caller, role string, progress func(line string) error) error
}

// LogsBackend is a Backend that can follow an instance's log.
type LogsBackend interface {
	// FollowInstanceLogs calls fn with up to n recent log lines of role's
	// instance (n < 1: all kept), then with every new line as it comes,
	// until ctx ends (nil), fn returns an error (that error) or the role
	// has no instance any more (ErrNotFound, also at once when it has
	// none). An instance replaced meanwhile (retried, respecified) is
	// followed on in its successor.
	FollowInstanceLogs(ctx context.Context, role string, n int, fn func(LogLine) error) error
}

// Errors a Backend wraps so the client learns what happened; the client
// returns errors that match them with errors.Is.
var (
	ErrInvalid       = errors.New("invalid request")
	ErrNotFound      = errors.New("not found")
	ErrConflict      = errors.New("conflict")
	ErrNotConfigured = errors.New("not configured")
	ErrForbidden     = errors.New("permission denied")
	// ErrInUse is returned by Listen when a live agent answers on the
	// socket path.
	ErrInUse = errors.New("another agent is listening on the admin socket")
	// ErrUnreachable is returned by the client when no agent answers on
	// the socket within its wait.
	ErrUnreachable = errors.New("agent unreachable")
)

// Error codes on the wire.
const (
	codeInvalid       = "invalid"
	codeNotFound      = "not_found"
	codeConflict      = "conflict"
	codeNotConfigured = "not_configured"
	codeForbidden     = "forbidden"
	codeInternal      = "internal"
)

var codeErrs = map[string]error{
	codeInvalid:       ErrInvalid,
	codeNotFound:      ErrNotFound,
	codeConflict:      ErrConflict,
	codeNotConfigured: ErrNotConfigured,
	codeForbidden:     ErrForbidden,
}

// APIError is a non-2xx answer of the admin API, as the client returns it.
// errors.Is matches it against ErrInvalid, ErrNotFound, ErrConflict,
// ErrNotConfigured and ErrForbidden by its code.
type APIError struct {
	Status  int    `json:"-"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *APIError) Error() string { return e.Message }

// Is matches the sentinel errors by code.
func (e *APIError) Is(target error) bool {
	s, ok := codeErrs[e.Code]
	return ok && s == target
}

type errorBody struct {
	Error APIError `json:"error"`
}

// Errorf returns an error with its own message that errors.Is matches
// against kind (ErrInvalid, ErrNotFound, ErrConflict, ErrNotConfigured,
// ErrForbidden), so the client learns the kind without the message saying
// it twice.
func Errorf(kind error, format string, args ...any) error {
	return &kindError{kind: kind, err: fmt.Errorf(format, args...)}
}

type kindError struct {
	kind error
	err  error
}

func (e *kindError) Error() string   { return e.err.Error() }
func (e *kindError) Unwrap() []error { return []error{e.kind, e.err} }
