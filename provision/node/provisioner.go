package node

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// IntentStore keeps node records (intents) by node name. Put and Delete are
// durable when they return. Implementations are safe for concurrent use.
type IntentStore interface {
	Put(rec Record) error
	Delete(name string) error
	List() ([]Record, error)
}

// ProvisionerConfig configures a Provisioner.
type ProvisionerConfig struct {
	// Lease is the provider; required.
	Lease Lease
	// Clients makes the bootstrap session's client; required.
	Clients ClientFactory
	// Sink receives the bootstrap log; nil drops it.
	Sink Sink
	// Intents stores the record after every change, before the command
	// that change calls for runs (so the intent exists before the lease
	// does), and deletes it once the lease is destroyed. Nil: nothing is
	// stored.
	Intents IntentStore
	// OnChange is told every new record (progress, audit). It runs on the
	// provisioner's goroutine and must not block for long.
	OnChange func(Record)
	// TeardownTimeout bounds a teardown that runs because ctx ended.
	// Default 2m.
	TeardownTimeout time.Duration
}

// Provisioner drives one node through its Machine (the reference design's
// DockerNodeProvisioner, for any Lease): it runs the commands the machine
// returns, last in first out, and feeds each result back as a message.
// Any failure tears the node down (cancel the session, destroy the lease)
// and returns the original error. Its methods must not be called
// concurrently: cancel a running Start through its context.
type Provisioner struct {
	cfg     ProvisionerConfig
	m       *Machine
	plan    Plan
	session *Session

	teardownComplete bool
}

// NewProvisioner returns a provisioner with no node.
func NewProvisioner(cfg ProvisionerConfig) (*Provisioner, error) {
	if cfg.Lease == nil || cfg.Clients == nil {
		return nil, errors.New("node provisioner: Lease and Clients are required")
	}
	if cfg.Sink == nil {
		cfg.Sink = discardSink{}
	}
	if cfg.TeardownTimeout <= 0 {
		cfg.TeardownTimeout = 2 * time.Minute
	}
	return &Provisioner{cfg: cfg, m: NewMachine(), teardownComplete: true}, nil
}

// Adopt returns a provisioner holding rec, a node recorded in the state
// store (converged, or left half done by a crash), so that Stop tears it
// down. It owns the node: Close tears it down too.
func Adopt(cfg ProvisionerConfig, rec Record) (*Provisioner, error) {
	p, err := NewProvisioner(cfg)
	if err != nil {
		return nil, err
	}
	p.m = Resume(rec)
	p.teardownComplete = false
	return p, nil
}

// Record returns the node's record; ok is false before Start.
func (p *Provisioner) Record() (Record, bool) { return p.m.Record() }

// Ready reports whether the node converged.
func (p *Provisioner) Ready() bool { return p.m.Converged() }

// Session returns the bootstrap session, nil before it started.
func (p *Provisioner) Session() *Session { return p.session }

func (p *Provisioner) name() string {
	if r, ok := p.m.Record(); ok {
		return r.Spec.Name
	}
	return ""
}

// handle feeds msg to the machine, then stores and announces the new
// record.
func (p *Provisioner) handle(msg Msg) ([]Command, error) {
	cmds, err := p.m.Handle(msg)
	if err != nil {
		return nil, nodeErr(ErrNode, p.name(), err)
	}
	rec, _ := p.m.Record()
	if p.cfg.Intents != nil {
		if rec.Phase == PhaseDestroyed {
			err = p.cfg.Intents.Delete(rec.Spec.Name)
		} else {
			err = p.cfg.Intents.Put(rec)
		}
		if err != nil {
			return nil, nodeErr(ErrNode, rec.Spec.Name, fmt.Errorf("store intent: %w", err))
		}
	}
	if p.cfg.OnChange != nil {
		p.cfg.OnChange(rec)
	}
	return cmds, nil
}

// Start leases the host for spec and runs the bootstrap session, which
// installs what plan renders for the lease's endpoint, up to
// waiting_for_join. The intent is stored before the lease is created. On
// any failure (ctx ending included) the node is torn down and the
// original error returned.
func (p *Provisioner) Start(ctx context.Context, spec Spec, plan Plan) error {
	if err := spec.Validate(); err != nil {
		return nodeErr(ErrNode, spec.Name, err)
	}
	if plan == nil {
		plan = func(context.Context, Endpoint) (Install, error) { return Install{}, nil }
	}
	p.plan = plan
	cmds, err := p.handle(MsgStart{Spec: spec})
	if err != nil {
		return err
	}
	p.teardownComplete = false
	if err := p.process(ctx, cmds); err != nil {
		tctx, cancel := p.teardownCtx(ctx)
		defer cancel()
		if terr := p.Stop(tctx); terr != nil {
			var ne *Error
			if errors.As(err, &ne) {
				ne.Teardown = terr
			}
		}
		return err
	}
	return nil
}

func (p *Provisioner) teardownCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), p.cfg.TeardownTimeout)
}

// ObserveJoin tells the node it was seen joined as member: the session
// flushes its log and closes, and the node is converged.
func (p *Provisioner) ObserveJoin(ctx context.Context, member string) error {
	if _, ok := p.m.Record(); !ok {
		return nodeErr(ErrNode, "", errors.New("node provisioner not started"))
	}
	cmds, err := p.handle(MsgJoined{Member: member})
	if err != nil {
		return err
	}
	return p.process(ctx, cmds)
}

// Stop tears the node down: the session is cancelled, the lease destroyed,
// the intent deleted. Before Start it does nothing.
func (p *Provisioner) Stop(ctx context.Context) error {
	if _, ok := p.m.Record(); !ok {
		p.teardownComplete = true
		return nil
	}
	cmds, err := p.handle(MsgDestroy{})
	if err != nil {
		return err
	}
	if err := p.processStop(ctx, cmds); err != nil {
		return err
	}
	p.teardownComplete = true
	return nil
}

// Close carries the rule the reference design gives its destructor: a
// node whose teardown is not complete is torn down. That includes a
// converged node: an owner that hands a converged node over to the state
// store (the Manager) lets go of its provisioner without closing it.
func (p *Provisioner) Close() error {
	if p.teardownComplete {
		return nil
	}
	ctx, cancel := p.teardownCtx(context.Background())
	defer cancel()
	return p.Stop(ctx)
}

func (p *Provisioner) process(ctx context.Context, cmds []Command) error {
	pending := cmds
	for len(pending) > 0 {
		cmd := pending[len(pending)-1]
		pending = pending[:len(pending)-1]
		var more []Command
		var err error
		switch c := cmd.(type) {
		case CmdCreateLease:
			facts, ep, cerr := p.cfg.Lease.Create(ctx, c.Spec)
			if cerr != nil {
				return nodeErr(ErrProvider, p.name(), cerr)
			}
			more, err = p.handle(MsgLeaseCreated{Lease: facts, Endpoint: ep})
		case CmdLookupEndpoint:
			ep, ok, lerr := p.cfg.Lease.LookupEndpoint(ctx, c.Lease)
			if lerr != nil {
				return nodeErr(ErrProvider, p.name(), lerr)
			}
			if !ok {
				_, _ = p.handle(MsgEndpointFailed{Reason: fmt.Sprintf("%s ssh endpoint unavailable", c.Lease.Provider)})
				return &Error{Kind: ErrEndpointUnavailable, Node: p.name(), Lease: c.Lease.ID,
					Reason: fmt.Sprintf("the %s lease has no ssh endpoint", c.Lease.Provider)}
			}
			more, err = p.handle(MsgEndpointKnown{Endpoint: ep})
		case CmdStartBootstrap:
			err = p.startBootstrap(ctx, c)
		case CmdConvergenceObserved:
			if p.session == nil {
				return &Error{Kind: ErrMissingBootstrap, Node: p.name(), Reason: "convergence observed with no bootstrap session"}
			}
			err = p.feed(p.session.ConvergenceObserved(c.Member))
		case CmdCancelBootstrap, CmdDestroyLease:
			return &Error{Kind: ErrUnexpectedCommand, Node: p.name(), Reason: fmt.Sprintf("lifecycle command %T outside stop", cmd)}
		default:
			return &Error{Kind: ErrUnexpectedCommand, Node: p.name(), Reason: fmt.Sprintf("unknown command %T", cmd)}
		}
		if err != nil {
			return err
		}
		pending = append(pending, more...)
	}
	return nil
}

func (p *Provisioner) startBootstrap(ctx context.Context, c CmdStartBootstrap) error {
	rec, _ := p.m.Record()
	install, err := p.plan(ctx, c.Endpoint)
	if err != nil {
		reason := "plan the install: " + err.Error()
		_, _ = p.handle(MsgBootstrapFailed{Reason: reason})
		return &Error{Kind: ErrBootstrap, Node: rec.Spec.Name, Lease: c.Lease, Stage: StageCreated, Reason: reason, Err: err}
	}
	spec := SessionSpec{
		Run: rec.Spec.Run, Node: rec.Spec.Name, Lease: c.Lease, Endpoint: c.Endpoint,
		Boot: rec.Spec.Boot, Install: install,
		OnInstalled: func(it Installed) error {
			_, err := p.handle(MsgInstalled{Item: it})
			return err
		},
		OnNodeKey: func(pub string) error {
			_, err := p.handle(MsgNodeKey{PublicKey: pub})
			return err
		},
	}
	// Each event is fed back as it happens, so that progress is live.
	var feedErr error
	spec.OnEvent = func(e SessionEvent) {
		if feedErr == nil {
			feedErr = p.feed([]SessionEvent{e})
		}
	}
	s := NewSession(spec, p.cfg.Clients.ClientFor(spec))
	// Held before it starts, so that a teardown after any failure cancels
	// (closes) it.
	p.session = s
	events := s.Start(ctx, p.cfg.Sink)
	var reason string
	for _, e := range events {
		if e.Kind == EventFailed && reason == "" {
			reason = e.Reason
		}
	}
	if feedErr != nil {
		return feedErr
	}
	if reason != "" {
		return &Error{Kind: ErrBootstrap, Node: rec.Spec.Name, Lease: c.Lease, Stage: s.Stage(), Reason: reason}
	}
	return nil
}

// feed gives the machine what the session reported.
func (p *Provisioner) feed(events []SessionEvent) error {
	for _, e := range events {
		var msg Msg
		switch e.Kind {
		case EventObserved:
			msg = MsgBootstrapObserved{Observation: e.Observation}
		case EventFailed:
			msg = MsgBootstrapFailed{Reason: e.Reason, Stage: e.Observation.Stage}
		case EventClosed:
			msg = MsgBootstrapClosed{}
		default:
			continue
		}
		if _, err := p.handle(msg); err != nil {
			return err
		}
	}
	return nil
}

func (p *Provisioner) processStop(ctx context.Context, cmds []Command) error {
	for _, cmd := range cmds {
		switch c := cmd.(type) {
		case CmdCancelBootstrap:
			if p.session != nil {
				_ = p.session.Cancel()
			}
		case CmdDestroyLease:
			if err := p.cfg.Lease.Destroy(ctx, c.Handle); err != nil {
				return &Error{Kind: ErrProvider, Node: p.name(), Lease: c.Handle.LeaseID, Reason: "destroy lease: " + err.Error(), Err: err}
			}
			if _, err := p.handle(MsgLeaseDestroyed{}); err != nil {
				return err
			}
		default:
			return &Error{Kind: ErrUnexpectedCommand, Node: p.name(), Reason: fmt.Sprintf("unexpected stop command %T", cmd)}
		}
	}
	return nil
}

type discardSink struct{}

func (discardSink) Record(LogRecord) {}
func (discardSink) Flush()           {}
