package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// Client is the session's SSH boundary: one connection to one host.
// SSHClient is the real one; tests use fakes to fail each stage. Calls
// come from one goroutine, except Close, which may be called from another
// to cancel whatever is in flight.
type Client interface {
	// Connect dials ep, verifies its host key against ep's pins (before
	// authenticating) and authenticates, trying again while the host does
	// not answer; retry (nil: none) is told of each attempt that failed
	// and is made again. An error it gives up with is best a
	// *ConnectError (its Stage names the cause).
	Connect(ctx context.Context, ep Endpoint, retry func(ConnectRetry)) error
	// Run runs c on the host and returns its exit code. An error means
	// the command could not run to completion (connection lost, deadline,
	// cancelled), not that it exited non-zero.
	Run(ctx context.Context, c RemoteCommand) (int, error)
	// Close closes the connection; anything in flight fails. Idempotent.
	Close() error
}

// RemoteCommand is one command run on a host.
type RemoteCommand struct {
	// Line is run by the login user's shell.
	Line string
	// Stdin is copied to the command's standard input (nil: none).
	Stdin io.Reader
	// Stdout and Stderr receive the output line by line (nil: dropped).
	Stdout, Stderr func(line string)
	// Timeout bounds the command; 0 is the client's default.
	Timeout time.Duration
}

// ClientFactory makes the client of one session (the reference design's
// SshBootstrapClientFactory).
type ClientFactory interface {
	ClientFor(spec SessionSpec) Client
}

// SessionSpec is what one bootstrap session does.
type SessionSpec struct {
	Run      uint64
	Node     string
	Lease    LeaseID
	Endpoint Endpoint
	Boot     BootSpec
	// Install is what the session installs and starts at agent_starting.
	Install Install
	// OnInstalled is called before each thing is created on the host, so
	// that it is recorded before it exists; an error stops the install.
	OnInstalled func(Installed) error
	// OnNodeKey is called with the node's public key once read back.
	OnNodeKey func(pub string) error
	// OnEvent is told each event of Start as it happens (Start returns
	// them all as well).
	OnEvent func(SessionEvent)
}

// Session is one bootstrap of one host, stage by stage (the reference
// design's SshBootstrapSession). Every output line of every command it
// runs is a LogRecord with the next sequence number. Not safe for
// concurrent use, except Cancel.
type Session struct {
	spec   SessionSpec
	client Client
	sink   Sink

	stage         Stage
	nextSeq       uint64
	lastStdoutSeq uint64
	lastStderrSeq uint64
	closed        bool
}

// NewSession returns a session in stage created.
func NewSession(spec SessionSpec, client Client) *Session {
	return &Session{spec: spec, client: client, stage: StageCreated, nextSeq: 1}
}

// Stage is the session's stage.
func (s *Session) Stage() Stage { return s.stage }

// Closed reports whether the session closed its client.
func (s *Session) Closed() bool { return s.closed }

// LastSeqs returns the last sequence numbers of stdout and stderr (0: none).
func (s *Session) LastSeqs() (stdout, stderr uint64) { return s.lastStdoutSeq, s.lastStderrSeq }

// Start runs the bootstrap up to waiting_for_join and returns what it
// observed; a step that fails ends it with a failed event, at the failure
// stage of that step. A cancelled ctx ends it at stage cancelled.
func (s *Session) Start(ctx context.Context, sink Sink) []SessionEvent {
	s.sink = sink
	var events []SessionEvent
	report := func(e SessionEvent) {
		events = append(events, e)
		if s.spec.OnEvent != nil {
			s.spec.OnEvent(e)
		}
	}
	fail := func(stage Stage, format string, err error) []SessionEvent {
		s.stage = stage
		if ctx.Err() != nil {
			s.stage = StageCancelled
		}
		report(SessionEvent{Kind: EventFailed, Reason: fmt.Sprintf(format, err), Observation: Observation{Stage: s.stage}})
		return events
	}

	s.stage = StageConnecting
	ep := s.spec.Endpoint
	report(observed(StageConnecting, ep.String()))
	retry := func(r ConnectRetry) {
		report(SessionEvent{Kind: EventObserved, Observation: Observation{Stage: StageConnecting, Attempt: r.Attempt, Marker: ep.String() + ": " + r.String()}})
	}
	if err := s.client.Connect(ctx, ep, retry); err != nil {
		return fail(connectStage(err), "ssh connect: %v", err)
	}
	if err := s.probe(ctx); err != nil {
		return fail(StageProbeFailed, "ssh probe: %v", err)
	}
	s.stage = StageReady
	report(observed(StageReady, ep.String()+", host key verified"))

	s.stage = StageStdoutStreaming
	report(observed(StageStdoutStreaming, fmt.Sprintf("%d log source(s)", len(s.spec.Boot.StdoutSources)+len(s.spec.Boot.StderrSources))))
	if err := s.readLogs(ctx); err != nil {
		return fail(StageStreamError, "bootstrap log stream: %v", err)
	}
	report(SessionEvent{Kind: EventObserved, Observation: s.observation(StageStdoutStreaming, "read")})

	s.stage = StageBootChecking
	report(observed(StageBootChecking, fmt.Sprintf("%d check(s)", len(s.spec.Boot.Verify))))
	if err := s.verify(ctx); err != nil {
		return fail(StageBootCheckFailed, "boot check failed: %v", err)
	}

	s.stage = StageAgentStarting
	report(observed(StageAgentStarting, strings.Join(s.spec.Install.Units, ", ")))
	if err := s.install(ctx); err != nil {
		return fail(StageStartFailed, "agent start failed: %v", err)
	}

	s.stage = StageWaitingForJoin
	report(SessionEvent{Kind: EventObserved, Observation: s.observation(StageWaitingForJoin, "the agent runs on the node")})
	return events
}

// connectStage is the failure stage of a Connect error: its own, else by
// its kind.
func connectStage(err error) Stage {
	var ce *ConnectError
	switch {
	case errors.As(err, &ce):
		return ce.Stage
	case errors.Is(err, ErrHostKeyMismatch):
		return StageHostKeyMismatch
	case errors.Is(err, ErrAuthFailed):
		return StageSSHAuthFailed
	}
	return StageSSHTimeout
}

// ConvergenceObserved ends a session whose node joined as member: the sink
// is flushed (the bootstrap log is complete) and the client closed.
func (s *Session) ConvergenceObserved(member string) []SessionEvent {
	s.stage = StageConverged
	if s.sink != nil {
		s.sink.Flush()
	}
	_ = s.client.Close()
	s.closed = true
	s.stage = StageClosed
	return []SessionEvent{
		{Kind: EventObserved, Observation: s.observation(StageConverged, member)},
		{Kind: EventClosed},
	}
}

// Cancel closes the client, ending whatever runs; the sink is not
// flushed. It may be called from another goroutine than Start's.
func (s *Session) Cancel() []SessionEvent {
	_ = s.client.Close()
	s.closed = true
	s.stage = StageCancelled
	return []SessionEvent{{Kind: EventClosed}}
}

func (s *Session) observation(stage Stage, marker string) Observation {
	return Observation{Stage: stage, LastStdoutSeq: s.lastStdoutSeq, LastStderrSeq: s.lastStderrSeq, Marker: marker}
}

// emitter returns a line callback that records each line on stream with
// the next sequence number.
func (s *Session) emitter(stream Stream) func(string) {
	return func(line string) {
		seq := s.nextSeq
		s.nextSeq++
		if stream == Stdout {
			s.lastStdoutSeq = seq
		} else {
			s.lastStderrSeq = seq
		}
		if s.sink != nil {
			s.sink.Record(LogRecord{
				Run: s.spec.Run, Node: s.spec.Node, Lease: s.spec.Lease, Source: SourceSSHBootstrap,
				Stream: stream, Seq: seq, Time: time.Now(), Line: line,
			})
		}
	}
}

func (s *Session) asRoot(line string) string { return asRoot(s.spec.Endpoint.User, line) }

// asRoot runs line as root: through sudo when the login user is not root.
func asRoot(user, line string) string {
	if user == "root" {
		return line
	}
	return "sudo -n -- sh -c " + shellQuote(line)
}

// exec runs line as root with its output recorded, and returns an error
// for a non-zero exit that names it and quotes its last stderr line.
func (s *Session) exec(ctx context.Context, line string, stdin io.Reader, stdout func(string)) error {
	var lastErr string
	errOut := s.emitter(Stderr)
	out := s.emitter(Stdout)
	if stdout != nil {
		rec := out
		out = func(l string) { rec(l); stdout(l) }
	}
	code, err := s.client.Run(ctx, RemoteCommand{
		Line: s.asRoot(line), Stdin: stdin, Stdout: out,
		Stderr: func(l string) { lastErr = l; errOut(l) },
	})
	if err != nil {
		return err
	}
	if code != 0 {
		if lastErr != "" {
			return fmt.Errorf("exit %d: %s", code, lastErr)
		}
		return fmt.Errorf("exit %d", code)
	}
	return nil
}

func (s *Session) probe(ctx context.Context) error {
	token := fmt.Sprintf("infermesh-probe-%d", s.spec.Run)
	var got []string
	code, err := s.client.Run(ctx, RemoteCommand{Line: "echo " + token, Stdout: func(l string) { got = append(got, l) }})
	if err != nil {
		return err
	}
	if code != 0 || len(got) == 0 || strings.TrimSpace(got[0]) != token {
		return fmt.Errorf("echo answered %q with exit %d, want %q", strings.Join(got, "\\n"), code, token)
	}
	return nil
}

// readLogs streams the boot log sources: stdout sources' lines as stdout
// records, stderr sources' as stderr (what a source writes to its own
// stderr is stderr either way). A source that cannot be read is a stream
// error.
func (s *Session) readLogs(ctx context.Context) error {
	for _, src := range s.spec.Boot.StdoutSources {
		if err := s.exec(ctx, src, nil, nil); err != nil {
			return fmt.Errorf("%s: %w", src, err)
		}
	}
	for _, src := range s.spec.Boot.StderrSources {
		errOut := s.emitter(Stderr)
		code, err := s.client.Run(ctx, RemoteCommand{Line: s.asRoot(src), Stdout: errOut, Stderr: errOut})
		if err == nil && code != 0 {
			err = fmt.Errorf("exit %d", code)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", src, err)
		}
	}
	return nil
}

func (s *Session) verify(ctx context.Context) error {
	for _, c := range s.spec.Boot.Verify {
		if err := s.exec(ctx, c.Command, nil, nil); err != nil {
			if c.Hint != "" {
				return fmt.Errorf("%s: %s (%w)", c.Name, c.Hint, err)
			}
			return fmt.Errorf("%s: %w", c.Name, err)
		}
	}
	return nil
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
