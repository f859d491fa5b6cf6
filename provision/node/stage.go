package node

import "time"

// Stage is where a bootstrap session is.
type Stage string

// Session stages, in the order a successful bootstrap passes them, with
// the failure each step can end in.
const (
	StageCreated    Stage = "created"
	StageConnecting Stage = "connecting"
	// Connect failures, by cause.
	StageSSHUnreachable  Stage = "ssh_unreachable"   // no TCP connection (refused, no route) until the connect timeout
	StageHostKeyMismatch Stage = "host_key_mismatch" // the host presented a key that is not pinned (both are named)
	StageSSHAuthFailed   Stage = "ssh_auth_failed"   // the host refused this agent's key
	StageSSHTimeout      Stage = "ssh_timeout"       // connected, but no SSH session within the deadlines
	StageProbeFailed     Stage = "probe_failed"      // connected, but the first command failed
	StageReady           Stage = "ready"
	StageStdoutStreaming Stage = "stdout_streaming"
	StageStreamError     Stage = "stream_error"
	StageBootChecking    Stage = "boot_checking"
	StageBootCheckFailed Stage = "boot_check_failed"
	StageAgentStarting   Stage = "agent_starting"
	StageStartFailed     Stage = "start_failed"
	StageWaitingForJoin  Stage = "waiting_for_join"
	StageConverged       Stage = "converged"
	StageClosed          Stage = "closed"
	StageCancelled       Stage = "cancelled"
)

// Failed reports whether s is a failure stage.
func (s Stage) Failed() bool {
	switch s {
	case StageSSHUnreachable, StageHostKeyMismatch, StageSSHAuthFailed, StageSSHTimeout, StageProbeFailed,
		StageStreamError, StageBootCheckFailed, StageStartFailed, StageCancelled:
		return true
	}
	return false
}

// Stream says which output stream a log line came from.
type Stream string

// Streams.
const (
	Stdout Stream = "stdout"
	Stderr Stream = "stderr"
)

// SourceSSHBootstrap is the Source of every record a session writes.
const SourceSSHBootstrap = "ssh_bootstrap"

// LogRecord is one line of a node's bootstrap log. Seq is shared by stdout
// and stderr: it orders every line of a session, starting at 1.
type LogRecord struct {
	Run    uint64    `json:"run"`
	Node   string    `json:"node"`
	Lease  LeaseID   `json:"lease"`
	Source string    `json:"source"`
	Stream Stream    `json:"stream"`
	Seq    uint64    `json:"seq"`
	Time   time.Time `json:"time"`
	Line   string    `json:"line"`
}

// Sink receives a session's log records. A session calls it from one
// goroutine at a time, never concurrently; Record must not block for
// long. Flush is called once the node converged (and never on cancel):
// what was recorded is then complete.
type Sink interface {
	Record(LogRecord)
	Flush()
}

// Observation is what a session reports at a stage: the stage and the
// last sequence numbers of each stream so far (0: none yet).
type Observation struct {
	Stage         Stage  `json:"stage"`
	LastStdoutSeq uint64 `json:"last_stdout_seq,omitempty"`
	LastStderrSeq uint64 `json:"last_stderr_seq,omitempty"`
	// Marker is a short note about the stage (what was connected, which
	// check ran), for the operator.
	Marker string `json:"marker,omitempty"`
	// Attempt numbers a connect attempt that failed and is made again
	// (stage connecting; Marker says why and when the next one is).
	Attempt int `json:"attempt,omitempty"`
}

// SessionEventKind says what a SessionEvent is.
type SessionEventKind uint8

// Session event kinds.
const (
	EventObserved SessionEventKind = iota + 1 // Observation
	EventFailed                               // Reason
	EventClosed                               // the session closed its client
)

// SessionEvent is one result of a session step, fed to the Machine. A
// failed event's Observation.Stage is the failure stage.
type SessionEvent struct {
	Kind        SessionEventKind
	Observation Observation
	Reason      string
}

func observed(s Stage, marker string) SessionEvent {
	return SessionEvent{Kind: EventObserved, Observation: Observation{Stage: s, Marker: marker}}
}
