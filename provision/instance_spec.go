package provision

import (
	"fmt"
	"hash/fnv"
	"sort"
	"strings"
	"time"

	"github.com/infermesh/infermesh/internal/defaults"
)

// ResourceStatus is what Status reports about an instance's resource
// (for Docker: its container; for a native instance: its process).
type ResourceStatus struct {
	ID        string // container id, or pid
	Running   bool
	ExitCode  int
	StartedAt time.Time
	Pid       int
	// Failure says why the runtime ended the last run when it knows, ""
	// when the process exited by itself or runs: "out of memory: ...".
	Failure string
	// Endpoints maps the instance's TCP ports to the loopback address
	// they answer on ("127.0.0.1:32768": a container's published port; a
	// native process's own port).
	Endpoints map[int]string
}

// RestartPolicy bounds restarts of an instance that exited or stopped
// answering. Zero fields take the defaults.
type RestartPolicy struct {
	// Max restarts within Window before giving up. Default 5.
	Max int
	// Window over which restarts are counted. Default 10m.
	Window time.Duration
	// Backoff before the first restart in a window; it doubles with each
	// further restart in the window, up to 1m. Default 2s.
	Backoff time.Duration
}

// DefaultRestartPolicy returns the defaults of every field.
func DefaultRestartPolicy() RestartPolicy {
	return RestartPolicy{Max: 5, Window: 10 * time.Minute, Backoff: 2 * time.Second}
}

func (p RestartPolicy) withDefaults() RestartPolicy {
	d := DefaultRestartPolicy()
	defaults.Positive(&p.Max, d.Max)
	defaults.Positive(&p.Window, d.Window)
	defaults.Positive(&p.Backoff, d.Backoff)
	return p
}

// Defaults of InstanceSpec.
const (
	DefaultHealthPath = "/health"
	DefaultRuntime    = RuntimeDocker
)

// InstanceSpec is the desired local instance of one role (the config's
// roles.<role>.instance). The Manager turns it into a ProvisionSpec per
// attempt.
type InstanceSpec struct {
	// Image is a container's image (runtime docker).
	Image string
	// Command is a native instance's executable, an absolute path
	// (runtime native).
	Command string
	Args    []string
	Env     map[string]string
	// Port is the port the server listens on: inside the container, which
	// publishes it on 127.0.0.1 at a port the engine picks; or, for a
	// native process, on 127.0.0.1 itself.
	Port   int
	Mounts []Mount
	// Health is the readiness path probed with GET. Default
	// DefaultHealthPath.
	Health string
	// Model is the model the instance knows (registered in placement).
	Model string
	// Runtime selects the provider (RuntimeDocker, RuntimeNative) and is
	// reported in placement. Default DefaultRuntime.
	Runtime string
	Restart RestartPolicy
	// Resources are a container's GPUs, /dev/shm and limits (docker).
	Resources *Resources
	// StartTimeout is how long a started instance may take to answer its
	// first health probe before it is restarted (a large model can take
	// minutes to load). Zero means the Manager's ReadyTimeout. It does not
	// alter the container: changing it re-supervises, never replaces.
	StartTimeout time.Duration
}

// validate checks what the Manager adds to a provider spec (the health
// path), then the provider spec of any attempt: one set of rules for the
// image or command, port, environment and mounts.
func (s InstanceSpec) validate() error {
	if s.Health != "" && !strings.HasPrefix(s.Health, "/") {
		return fmt.Errorf("health %q does not start with /", s.Health)
	}
	if s.StartTimeout < 0 {
		return fmt.Errorf("start timeout %v is negative", s.StartTimeout)
	}
	return s.provisionSpec("", 1).Validate()
}

// provisionSpec is the provider spec of the role's instance at attempt.
// Role instances are not part of a run (RunID 0); InstanceID is a stable
// digest of the role so observations carry a useful number.
func (s InstanceSpec) provisionSpec(role string, attempt uint64) ProvisionSpec {
	keys := make([]string, 0, len(s.Env))
	for k := range s.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	env := make([]EnvVar, 0, len(keys))
	for _, k := range keys {
		env = append(env, EnvVar{Name: k, Value: s.Env[k]})
	}
	h := fnv.New64a()
	h.Write([]byte(role))
	ps := ProvisionSpec{
		InstanceID: h.Sum64(),
		AttemptID:  attempt,
		Image:      s.Image,
		Env:        env,
		Args:       append([]string(nil), s.Args...),
		Mounts:     append([]Mount(nil), s.Mounts...),
		Role:       role,
		Ports:      []int{s.Port},
		Command:    s.Command,
	}
	if s.Resources != nil {
		r := *s.Resources
		ps.Resources = &r
	}
	if s.Runtime != "" && s.Runtime != RuntimeDocker {
		ps.Runtime = s.Runtime // Docker is "" in a ProvisionSpec
	}
	return ps
}

// InstanceState is where an instance is in its lifecycle.
type InstanceState string

// Instance states.
const (
	StatePending    InstanceState = "pending"    // desired, not yet started
	StatePulling    InstanceState = "pulling"    // fetching the image (docker)
	StateStarting   InstanceState = "starting"   // container up, waiting for its health probe
	StateReady      InstanceState = "ready"      // answering, registered in placement
	StateUnhealthy  InstanceState = "unhealthy"  // running but not answering; deregistered
	StateRestarting InstanceState = "restarting" // exited or gave no answer; restart pending (backoff)
	StateError      InstanceState = "error"      // the runtime failed (e.g. daemon unreachable); retrying
	StateFailed     InstanceState = "failed"     // over its restart policy; given up
	StateStopped    InstanceState = "stopped"    // stopped by the operator; kept stopped until Retry
	StateRemoving   InstanceState = "removing"   // role removed; container being stopped
)

// InstanceStatus is the operator view of one role's instance.
type InstanceStatus struct {
	Role        string
	State       InstanceState
	Runtime     string
	Ref         string // container name, or native workload ref
	ContainerID string
	PID         int    // a native instance's process
	Endpoint    string // loopback address it answers on, "127.0.0.1:port"
	Image       string // image, or a native instance's command
	Attempt     uint64
	SpecHash    string
	Restarts    int // restarts since this manager started supervising it
	LastEvent   Event
	LastError   string
	Since       time.Time // when State was entered
}
