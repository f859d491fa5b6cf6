package node

import (
	"fmt"
	"time"
)

// Phase is where a node is in its life, as the Machine tracks it.
type Phase string

// Phases.
const (
	PhaseLeasing        Phase = "leasing"          // creating the lease
	PhaseLocating       Phase = "locating"         // looking up the lease's SSH endpoint
	PhaseBootstrapping  Phase = "bootstrapping"    // the session runs
	PhaseWaitingForJoin Phase = "waiting_for_join" // the agent runs on the node; not joined yet
	PhaseConverged      Phase = "converged"        // joined: admitted, adverts heard
	PhaseFailed         Phase = "failed"           // a step failed; teardown follows
	PhaseDestroying     Phase = "destroying"       // tearing the lease down
	PhaseDestroyed      Phase = "destroyed"        // nothing is left
)

// Record is what the Machine knows of its node. It is the node's intent in
// the state store.
type Record struct {
	Spec  Spec  `json:"spec"`
	Phase Phase `json:"phase"`
	// Stage is the session's last observed stage ("" before the session).
	Stage         Stage       `json:"stage,omitempty"`
	Lease         *LeaseFacts `json:"lease,omitempty"`
	Endpoint      *Endpoint   `json:"endpoint,omitempty"`
	LastStdoutSeq uint64      `json:"last_stdout_seq,omitempty"`
	LastStderrSeq uint64      `json:"last_stderr_seq,omitempty"`
	SessionOpen   bool        `json:"session_open,omitempty"`
	// PublicKey is the node key made on the host (base64), once read back.
	PublicKey string `json:"public_key,omitempty"`
	// Member is the name the node joined the mesh as.
	Member string `json:"member,omitempty"`
	// Failure is why the node failed, when it did.
	Failure string `json:"failure,omitempty"`
	// Note says what the last step was about (the lease, the endpoint,
	// the check), for the operator.
	Note string `json:"note,omitempty"`
	// Attempt is the connect attempt that failed last, while connecting
	// (0: none yet); Note says why.
	Attempt int       `json:"attempt,omitempty"`
	Updated time.Time `json:"updated"`
}

// Msg is a message to the Machine: a request or the result of a command.
type Msg interface{ msg() }

// Messages.
type (
	// MsgStart starts a node.
	MsgStart struct{ Spec Spec }
	// MsgLeaseCreated: CmdCreateLease succeeded. Endpoint is nil when the
	// provider did not know it yet (CmdLookupEndpoint follows).
	MsgLeaseCreated struct {
		Lease    LeaseFacts
		Endpoint *Endpoint
	}
	// MsgEndpointKnown: CmdLookupEndpoint found the endpoint.
	MsgEndpointKnown struct{ Endpoint Endpoint }
	// MsgEndpointFailed: CmdLookupEndpoint found none.
	MsgEndpointFailed struct{ Reason string }
	// MsgBootstrapObserved: the session reached a stage.
	MsgBootstrapObserved struct{ Observation Observation }
	// MsgBootstrapFailed: the session failed, at Stage (a failure stage;
	// "": the record keeps its last stage).
	MsgBootstrapFailed struct {
		Reason string
		Stage  Stage
	}
	// MsgBootstrapClosed: the session closed its client.
	MsgBootstrapClosed struct{}
	// MsgInstalled: the session is about to create something on the host.
	MsgInstalled struct{ Item Installed }
	// MsgNodeKey: the session read the node's public key back.
	MsgNodeKey struct{ PublicKey string }
	// MsgJoined: the node was seen admitted in the mesh as Member.
	MsgJoined struct{ Member string }
	// MsgDestroy asks for the node to be torn down.
	MsgDestroy struct{}
	// MsgLeaseDestroyed: CmdDestroyLease succeeded.
	MsgLeaseDestroyed struct{}
)

func (MsgStart) msg()             {}
func (MsgLeaseCreated) msg()      {}
func (MsgEndpointKnown) msg()     {}
func (MsgEndpointFailed) msg()    {}
func (MsgBootstrapObserved) msg() {}
func (MsgBootstrapFailed) msg()   {}
func (MsgBootstrapClosed) msg()   {}
func (MsgInstalled) msg()         {}
func (MsgNodeKey) msg()           {}
func (MsgJoined) msg()            {}
func (MsgDestroy) msg()           {}
func (MsgLeaseDestroyed) msg()    {}

// Command is what the Machine asks its runner (the Provisioner) to do.
type Command interface{ command() }

// Commands.
type (
	CmdCreateLease    struct{ Spec Spec }
	CmdLookupEndpoint struct{ Lease LeaseFacts }
	// CmdStartBootstrap runs the session against Endpoint.
	CmdStartBootstrap struct {
		Endpoint Endpoint
		Lease    LeaseID
	}
	// CmdConvergenceObserved tells the session the node joined.
	CmdConvergenceObserved struct{ Member string }
	CmdCancelBootstrap     struct{ Node string }
	CmdDestroyLease        struct{ Handle DestroyHandle }
)

func (CmdCreateLease) command()         {}
func (CmdLookupEndpoint) command()      {}
func (CmdStartBootstrap) command()      {}
func (CmdConvergenceObserved) command() {}
func (CmdCancelBootstrap) command()     {}
func (CmdDestroyLease) command()        {}

// Machine is a node's state machine: Handle takes a message, updates the
// record and returns the commands to run, without doing any I/O. It is not
// safe for concurrent use; its Provisioner serializes calls.
type Machine struct {
	rec *Record
	now func() time.Time
}

// NewMachine returns a machine with no node.
func NewMachine() *Machine { return &Machine{now: time.Now} }

// Resume returns a machine holding rec (an intent read back from the
// state store), so that it can be torn down or observed joining.
func Resume(rec Record) *Machine {
	r := rec
	return &Machine{rec: &r, now: time.Now}
}

// Record returns a copy of the node's record; ok is false before MsgStart.
func (m *Machine) Record() (Record, bool) {
	if m.rec == nil {
		return Record{}, false
	}
	r := *m.rec
	if r.Lease != nil {
		l := *r.Lease
		l.Installed = append([]Installed(nil), l.Installed...)
		r.Lease = &l
	}
	return r, true
}

// Converged reports whether the node joined.
func (m *Machine) Converged() bool { return m.rec != nil && m.rec.Phase == PhaseConverged }

func (m *Machine) refuse(msg Msg) error {
	phase := Phase("none")
	if m.rec != nil {
		phase = m.rec.Phase
	}
	return fmt.Errorf("%T in phase %s", msg, phase)
}

// Handle applies msg and returns the commands it calls for. A message
// that makes no sense in the current phase is refused with an error and
// changes nothing.
func (m *Machine) Handle(msg Msg) ([]Command, error) {
	if s, ok := msg.(MsgStart); ok {
		if m.rec != nil {
			return nil, fmt.Errorf("node %s already started (phase %s)", m.rec.Spec.Name, m.rec.Phase)
		}
		m.rec = &Record{Spec: s.Spec, Phase: PhaseLeasing, Note: "creating a " + string(s.Spec.Provider) + " lease", Updated: m.now()}
		return []Command{CmdCreateLease{Spec: s.Spec}}, nil
	}
	r := m.rec
	if r == nil {
		return nil, m.refuse(msg)
	}
	var cmds []Command
	if _, ok := msg.(MsgBootstrapObserved); !ok {
		r.Attempt = 0 // a failed connect attempt is news only until the next step
	}
	switch msg := msg.(type) {
	case MsgLeaseCreated:
		if r.Phase != PhaseLeasing {
			return nil, m.refuse(msg)
		}
		l := msg.Lease
		r.Lease = &l
		if msg.Endpoint == nil {
			r.Phase, r.Note = PhaseLocating, "looking up the ssh endpoint of "+string(l.ID)
			cmds = []Command{CmdLookupEndpoint{Lease: l}}
			break
		}
		cmds = m.bootstrap(*msg.Endpoint)
	case MsgEndpointKnown:
		if r.Phase != PhaseLocating {
			return nil, m.refuse(msg)
		}
		cmds = m.bootstrap(msg.Endpoint)
	case MsgEndpointFailed:
		if r.Phase != PhaseLocating {
			return nil, m.refuse(msg)
		}
		r.Phase, r.Failure, r.Note = PhaseFailed, msg.Reason, msg.Reason
	case MsgBootstrapObserved:
		if r.Phase != PhaseBootstrapping && r.Phase != PhaseWaitingForJoin {
			return nil, m.refuse(msg)
		}
		o := msg.Observation
		r.Stage, r.Note, r.Attempt = o.Stage, o.Marker, o.Attempt
		r.LastStdoutSeq = max(r.LastStdoutSeq, o.LastStdoutSeq)
		r.LastStderrSeq = max(r.LastStderrSeq, o.LastStderrSeq)
		switch o.Stage {
		case StageWaitingForJoin:
			r.Phase = PhaseWaitingForJoin
		case StageConverged:
			if r.Phase != PhaseWaitingForJoin {
				return nil, m.refuse(msg)
			}
			r.Phase = PhaseConverged
		}
	case MsgBootstrapFailed:
		if r.Phase != PhaseBootstrapping && r.Phase != PhaseWaitingForJoin {
			return nil, m.refuse(msg)
		}
		r.Phase, r.Failure, r.Note = PhaseFailed, msg.Reason, msg.Reason
		if msg.Stage != "" {
			r.Stage = msg.Stage
		}
	case MsgBootstrapClosed:
		r.SessionOpen = false
	case MsgInstalled:
		if r.Phase != PhaseBootstrapping || r.Lease == nil {
			return nil, m.refuse(msg)
		}
		r.Lease.Installed = append(r.Lease.Installed, msg.Item)
		r.Note = msg.Item.Kind + " " + msg.Item.Path
	case MsgNodeKey:
		if r.Phase != PhaseBootstrapping {
			return nil, m.refuse(msg)
		}
		r.PublicKey = msg.PublicKey
	case MsgJoined:
		if r.Phase != PhaseWaitingForJoin {
			return nil, m.refuse(msg)
		}
		r.Member = msg.Member
		cmds = []Command{CmdConvergenceObserved{Member: msg.Member}}
	case MsgDestroy:
		if r.Phase == PhaseDestroyed {
			break
		}
		if r.SessionOpen {
			cmds = append(cmds, CmdCancelBootstrap{Node: r.Spec.Name})
		}
		// Without lease facts the lease may still have been half created
		// (or created just before a crash): the provider finds it by the
		// node's name.
		h := DestroyHandle{Provider: r.Spec.Provider, Node: r.Spec.Name}
		if r.Lease != nil {
			h = r.Lease.DestroyHandle(r.Spec.Name)
		}
		if r.Endpoint != nil {
			ep := *r.Endpoint
			h.Endpoint = &ep
		}
		r.Phase = PhaseDestroying
		r.Note = "destroying the lease"
		if h.LeaseID != "" {
			r.Note += " " + string(h.LeaseID)
		}
		cmds = append(cmds, CmdDestroyLease{Handle: h})
	case MsgLeaseDestroyed:
		if r.Phase != PhaseDestroying {
			return nil, m.refuse(msg)
		}
		r.Phase, r.Lease, r.SessionOpen, r.Note = PhaseDestroyed, nil, false, "lease destroyed"
	default:
		return nil, fmt.Errorf("unknown message %T", msg)
	}
	r.Updated = m.now()
	return cmds, nil
}

func (m *Machine) bootstrap(ep Endpoint) []Command {
	r := m.rec
	r.Endpoint = &ep
	r.Phase = PhaseBootstrapping
	r.Stage, r.Note = StageCreated, ep.String()
	// The session exists from now until it reports closed: a teardown
	// cancels it whatever happened in between.
	r.SessionOpen = true
	return []Command{CmdStartBootstrap{Endpoint: ep, Lease: r.Lease.ID}}
}
