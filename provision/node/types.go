package node

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// Kind names a lease provider.
type Kind string

// Lease providers.
const (
	// KindDocker is a node container on this machine's Docker engine.
	KindDocker Kind = "docker"
	// KindSSH is an existing host reached over SSH.
	KindSSH Kind = "ssh"
)

// Spec is what `infermesh node add` asked for: the durable intent of one
// node, written to the state store before its lease is created. It holds
// no secret (the gossip keyring and the authority key travel in the Plan).
type Spec struct {
	// Name is the node's mesh name.
	Name string `json:"name"`
	// Run identifies this add attempt (labels, env, log records).
	Run      uint64        `json:"run"`
	Provider Kind          `json:"provider"`
	Docker   *DockerTarget `json:"docker,omitempty"`
	SSH      *SSHTarget    `json:"ssh,omitempty"`
	// Roles the node serves.
	Roles []Role `json:"roles"`
	// Join lists the gossip addresses the node joins.
	Join []string `json:"join"`
	// JoinCredentialRef says where the node's join credential (its
	// admission certificate) is kept on the node.
	JoinCredentialRef string `json:"join_credential_ref"`
	// Boot is what the session reads and checks before installing.
	Boot BootSpec `json:"boot"`
	// Created and By say when and by whom the node was added.
	Created time.Time `json:"created"`
	By      string    `json:"by,omitempty"`
}

// DockerTarget is where a docker node container runs.
type DockerTarget struct {
	// Image is the node image (internal/nodeimage).
	Image string `json:"image"`
	// Network is the Docker network the container joins; this agent's
	// mesh address must be reachable on it.
	Network string `json:"network"`
}

// SSHTarget is an existing host.
type SSHTarget struct {
	User string `json:"user"`
	Host string `json:"host"`
	Port int    `json:"port"`
	// HostKeys pin the host's keys (authorized_keys format, as the
	// operator's known_hosts has them); Fingerprints pin by SHA256
	// fingerprint. At least one pin is required.
	HostKeys     []string `json:"host_keys,omitempty"`
	Fingerprints []string `json:"fingerprints,omitempty"`
	// Advertise is the node's mesh address (an IP) as peers reach it.
	// Default: Host when it is an IP.
	Advertise string `json:"advertise,omitempty"`
}

// Role is one role the new node serves.
type Role struct {
	Name string `json:"name"`
	// Port is the role's loopback port on the node.
	Port int `json:"port"`
	// Upstream is the instance on the node (http://127.0.0.1:port).
	Upstream string `json:"upstream"`
	Model    string `json:"model,omitempty"`
	// Consumed: this agent has the role and accepts it from the node, so
	// the node's advert must arrive before it counts as converged.
	Consumed bool `json:"consumed"`
}

// BootSpec is what the session reads and checks on the host before it
// installs anything.
type BootSpec struct {
	// StdoutSources and StderrSources are commands whose output lines are
	// streamed as bootstrap log records, tagged stdout or stderr.
	StdoutSources []string `json:"stdout_sources,omitempty"`
	StderrSources []string `json:"stderr_sources,omitempty"`
	// Verify commands must all exit 0 (the boot check).
	Verify []Check `json:"verify,omitempty"`
}

// Check is one verify command.
type Check struct {
	Name    string `json:"name"`
	Command string `json:"command"`
	// Hint explains a failure to the operator.
	Hint string `json:"hint,omitempty"`
}

// Validate checks the fields every part relies on.
func (s Spec) Validate() error {
	if err := validName(s.Name); err != nil {
		return fmt.Errorf("node name: %w", err)
	}
	switch s.Provider {
	case KindDocker:
		if s.Docker == nil || s.Docker.Image == "" {
			return errors.New("docker node: no image")
		}
		if s.SSH != nil {
			return errors.New("docker node: an ssh target too")
		}
	case KindSSH:
		t := s.SSH
		if t == nil || t.Host == "" || t.User == "" {
			return errors.New("ssh node: want user@host")
		}
		if t.Port < 1 || t.Port > 65535 {
			return fmt.Errorf("ssh node: port %d out of range", t.Port)
		}
		if len(t.HostKeys) == 0 && len(t.Fingerprints) == 0 {
			return errors.New("ssh node: no host key pinned (known_hosts entry or fingerprint)")
		}
		// A pin that cannot match is refused here, before anything
		// dials the host.
		for _, f := range t.Fingerprints {
			if _, err := NormalizeFingerprint(f); err != nil {
				return fmt.Errorf("ssh node: %w", err)
			}
		}
		for i, k := range t.HostKeys {
			if _, err := ParseAuthorizedKey(k); err != nil {
				return fmt.Errorf("ssh node: pinned host key %d: %w", i, err)
			}
		}
		if s.Docker != nil {
			return errors.New("ssh node: a docker target too")
		}
	default:
		return fmt.Errorf("unknown provider %q (docker, ssh)", s.Provider)
	}
	if len(s.Roles) == 0 {
		return errors.New("no roles")
	}
	seen := map[string]bool{}
	for i, r := range s.Roles {
		if err := validName(r.Name); err != nil {
			return fmt.Errorf("roles[%d]: %w", i, err)
		}
		if seen[r.Name] {
			return fmt.Errorf("roles[%d]: %s listed twice", i, r.Name)
		}
		seen[r.Name] = true
		if r.Port < 1 || r.Port > 65535 {
			return fmt.Errorf("role %s: port %d out of range", r.Name, r.Port)
		}
		if r.Upstream == "" {
			return fmt.Errorf("role %s: no upstream", r.Name)
		}
	}
	if len(s.Join) == 0 {
		return errors.New("no join address")
	}
	return nil
}

// validName accepts the token names of nodes and roles: 1 to 63 of
// [A-Za-z0-9._-], starting with a letter or digit.
func validName(n string) error {
	if n == "" || len(n) > 63 {
		return fmt.Errorf("%q: want 1 to 63 characters", n)
	}
	for i, c := range []byte(n) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || (i > 0 && (c == '.' || c == '_' || c == '-'))
		if !ok {
			return fmt.Errorf("%q: character %q at %d is not allowed (letters, digits, '.', '_', '-')", n, c, i)
		}
	}
	return nil
}

// Endpoint is where a node's sshd answers and how it is verified.
type Endpoint struct {
	Host string `json:"host"`
	Port int    `json:"port"`
	User string `json:"user"`
	// HostKeys and Fingerprints pin the host key; one must match.
	HostKeys     []string `json:"host_keys,omitempty"`
	Fingerprints []string `json:"fingerprints,omitempty"`
}

// Addr is host:port.
func (e Endpoint) Addr() string { return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)) }

func (e Endpoint) String() string { return e.User + "@" + e.Addr() }

// LeaseID names a lease: "<provider>:<resource>".
type LeaseID string

// LeaseFacts are what a Lease holds for a node.
type LeaseFacts struct {
	Provider Kind    `json:"provider"`
	ID       LeaseID `json:"id"`
	// ContractID is the provider's resource: the container id, or the
	// host's user@host:port.
	ContractID string            `json:"contract_id"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	// HostKeys pin the resource's SSH host key (docker: generated by the
	// lease before the container started).
	HostKeys []string `json:"host_keys,omitempty"`
	// Installed lists what the bootstrap put on the host, in order,
	// recorded before each was created.
	Installed []Installed `json:"installed,omitempty"`
}

// DestroyHandle is what destroying the lease of node needs.
func (f LeaseFacts) DestroyHandle(node string) DestroyHandle {
	return DestroyHandle{
		Provider: f.Provider, Node: node, LeaseID: f.ID, ContractID: f.ContractID,
		Metadata: f.Metadata, HostKeys: f.HostKeys, Installed: append([]Installed(nil), f.Installed...),
	}
}

// DestroyHandle addresses a lease to destroy. A handle with no LeaseID
// comes from a node whose lease was being created when it failed (or the
// agent crashed): the provider destroys whatever it may have created for
// Node, found by the name it derives from it.
type DestroyHandle struct {
	Provider   Kind
	Node       string
	LeaseID    LeaseID
	ContractID string
	Metadata   map[string]string
	HostKeys   []string
	Installed  []Installed
	// Endpoint is where the lease's host answers (ssh: to undo Installed).
	Endpoint *Endpoint
}

// Installed is one thing the bootstrap put on a host.
type Installed struct {
	// Kind is "dir" (created, removed with its contents), "file" or
	// "unit" (enabled and started; disabled and stopped on removal).
	Kind string `json:"kind"`
	Path string `json:"path"`
}

// Installed kinds.
const (
	InstalledDir  = "dir"
	InstalledFile = "file"
	InstalledUnit = "unit"
	// InstalledParent is a directory a file needed that the host lacked
	// (/etc/sysusers.d on Debian): removed only when empty, since others
	// may put files there afterwards.
	InstalledParent = "parent"
)

// Errors by the reference design's kinds. Every error a Provisioner or
// Manager returns is an *Error matching one of them with errors.Is.
var (
	// ErrProvider: the lease provider failed (create, lookup, destroy).
	ErrProvider = errors.New("provider")
	// ErrNode: the state machine refused a message, or the intent could
	// not be stored.
	ErrNode = errors.New("node")
	// ErrEndpointUnavailable: the lease has no SSH endpoint.
	ErrEndpointUnavailable = errors.New("ssh endpoint unavailable")
	// ErrMissingBootstrap: convergence was observed with no session.
	ErrMissingBootstrap = errors.New("no bootstrap session")
	// ErrBootstrap: the session failed, or the node never joined.
	ErrBootstrap = errors.New("bootstrap failed")
	// ErrUnexpectedCommand: the state machine asked for a command where
	// it makes no sense.
	ErrUnexpectedCommand = errors.New("unexpected command")
)

// Errors callers of the Manager act on.
var (
	// ErrExists: a node of that name is recorded (or being added).
	ErrExists = errors.New("node exists")
	// ErrUnknown: no node of that name is recorded.
	ErrUnknown = errors.New("no such node")
	// ErrHostKeyMismatch: the host presented a key that is not pinned.
	ErrHostKeyMismatch = errors.New("host key mismatch")
)

// Error is a failure of one node: its kind (one of the Err* kinds above),
// the stage it failed at, and why.
type Error struct {
	Kind  error
	Node  string
	Lease LeaseID
	// Stage is the session's stage when it failed ("" before any).
	Stage Stage
	// Reason is the failure in words.
	Reason string
	// Err is the underlying error, when there is one.
	Err error
	// Teardown is set when the teardown that followed failed too: the
	// intent is kept so that `node remove` can finish it.
	Teardown error
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("node ")
	b.WriteString(e.Node)
	b.WriteString(": ")
	b.WriteString(e.Kind.Error())
	if e.Stage != "" {
		b.WriteString(" at ")
		b.WriteString(string(e.Stage))
	}
	if e.Lease != "" && errors.Is(e.Kind, ErrEndpointUnavailable) {
		b.WriteString(" (lease ")
		b.WriteString(string(e.Lease))
		b.WriteString(")")
	}
	if e.Reason != "" {
		b.WriteString(": ")
		b.WriteString(e.Reason)
	}
	if e.Teardown != nil {
		b.WriteString(" (teardown failed too: ")
		b.WriteString(e.Teardown.Error())
		b.WriteString("; the node is kept for `infermesh node remove`)")
	}
	return b.String()
}

// Unwrap matches the kind and the underlying error.
func (e *Error) Unwrap() []error {
	if e.Err != nil {
		return []error{e.Kind, e.Err}
	}
	return []error{e.Kind}
}

func nodeErr(kind error, node string, err error) *Error {
	return &Error{Kind: kind, Node: node, Reason: err.Error(), Err: err}
}
