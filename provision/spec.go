package provision

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/infermesh/infermesh/cleanup"
)

// ProvisionSpec is what a provider is asked to provision: one attempt of
// one instance (image, environment, arguments, mounts, published ports) and
// the ids that name it. It is the durable intent written before a resource
// is created, so it must JSON round-trip. Specs written by older versions
// decode: without mounts, attempt id, role or ports they get zero values;
// their "node_id" is read as the instance id (see UnmarshalJSON).
type ProvisionSpec struct {
	// RunID groups the attempts of one provisioning run. Role instances
	// belong to no run and carry 0; it names role-less instances.
	RunID uint64 `json:"run_id"`
	// InstanceID identifies the instance within its run. For a role's
	// instance it is a stable digest of the role, so observations carry a
	// useful number.
	InstanceID uint64 `json:"instance_id"`
	// AttemptID is the concrete attempt. Zero is reserved for an unbound
	// template: providers refuse to create a resource for it.
	AttemptID uint64   `json:"attempt_id"`
	Image     string   `json:"image"`
	Env       []EnvVar `json:"env"`
	Args      []string `json:"args"`
	Mounts    []Mount  `json:"mounts,omitempty"`
	// Role is the infermesh role the instance serves; "" for an instance
	// outside any role, which is then named by run and instance id.
	Role string `json:"role,omitempty"`
	// Ports are container TCP ports published on the host's loopback only;
	// for a native instance, the one port its process listens on.
	Ports []int `json:"ports,omitempty"`
	// Runtime is the provider's runtime: "" (Docker, what every intent
	// written before native instances means) or RuntimeNative.
	Runtime string `json:"runtime,omitempty"`
	// Command is a native instance's executable (absolute path); Image is
	// then empty.
	Command string `json:"command,omitempty"`
	// Resources are a container's devices and limits; nil is none (Docker
	// only).
	Resources *Resources `json:"resources,omitempty"`
}

// Resources are what a container may use beyond the defaults: GPUs, the
// size of /dev/shm (inference servers share tensors through it) and limits.
type Resources struct {
	// GPUs: "" none, "all", a count ("2"), or device ids or UUIDs
	// ("0,1", "GPU-3a..."), as docker run --gpus takes them.
	GPUs string `json:"gpus,omitempty"`
	// ShmSize is /dev/shm in bytes; 0 is the engine's default (64 MiB).
	ShmSize int64 `json:"shm_size,omitempty"`
	// Memory is the memory limit in bytes; 0 is none.
	Memory int64 `json:"memory,omitempty"`
	// NanoCPUs is the CPU limit in billionths of a CPU; 0 is none.
	NanoCPUs int64 `json:"nano_cpus,omitempty"`
}

// Runtimes of instances. A ProvisionSpec names Docker by "" (see
// ProvisionSpec.Runtime); configuration and status use the names.
const (
	RuntimeDocker    = string(cleanup.Docker)
	RuntimeNative    = string(cleanup.Native)
	RuntimeSimulated = string(cleanup.Simulated)
)

// RuntimeName is the runtime of the spec, by name.
func (s ProvisionSpec) RuntimeName() string {
	if s.Runtime == "" {
		return RuntimeDocker
	}
	return s.Runtime
}

// reservedEnv are the variables the native runtime sets in every
// instance's environment; a spec may not set them.
var reservedEnv = []string{"INFERMESH_SITE", "INFERMESH_NODE", "INFERMESH_ROLE", "INFERMESH_WORKLOAD", TokenEnv, "INFERMESH_CACHE_DIR"}

// UnmarshalJSON decodes a spec. Intents written before instances had their
// own word name the instance id "node_id", as the reference design's wire
// shape does; it is read when "instance_id" is absent. Their "stage_index"
// (a reference-design field infermesh never set) is ignored.
func (s *ProvisionSpec) UnmarshalJSON(b []byte) error {
	type plain ProvisionSpec // without this method: no recursion
	var v struct {
		plain
		InstanceID *uint64 `json:"instance_id"`
		NodeID     *uint64 `json:"node_id"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*s = ProvisionSpec(v.plain)
	switch {
	case v.InstanceID != nil:
		s.InstanceID = *v.InstanceID
	case v.NodeID != nil:
		s.InstanceID = *v.NodeID
	}
	return nil
}

// EnvVar is one environment variable. It encodes as a two-element JSON array
// ["NAME", "value"], the wire shape of the reference design.
type EnvVar struct {
	Name  string
	Value string
}

// MarshalJSON encodes the pair as ["NAME", "value"].
func (e EnvVar) MarshalJSON() ([]byte, error) {
	return json.Marshal([2]string{e.Name, e.Value})
}

// UnmarshalJSON decodes ["NAME", "value"].
func (e *EnvVar) UnmarshalJSON(b []byte) error {
	var pair []string
	if err := json.Unmarshal(b, &pair); err != nil {
		return fmt.Errorf("env var: %w", err)
	}
	if len(pair) != 2 {
		return fmt.Errorf("env var: want [name, value], got %d elements", len(pair))
	}
	e.Name, e.Value = pair[0], pair[1]
	return nil
}

// Mount is a host path bind-mounted into the instance.
type Mount struct {
	HostPath      string `json:"host_path"`
	ContainerPath string `json:"container_path"`
	ReadOnly      bool   `json:"readonly"`
}

// ErrTemplateSpec is returned when asked to create a resource for a spec
// whose AttemptID is 0 (an unbound template).
var ErrTemplateSpec = errors.New("spec is an unbound template (attempt id 0)")

// Validate checks the fields every provider relies on.
func (s ProvisionSpec) Validate() error {
	if s.AttemptID == 0 {
		return ErrTemplateSpec
	}
	switch s.Runtime {
	case "":
		if strings.TrimSpace(s.Image) == "" {
			return errors.New("spec: image is empty")
		}
		if s.Command != "" {
			return errors.New("spec: command is for native instances; a container runs its image")
		}
	case RuntimeNative:
		if !path.IsAbs(s.Command) {
			return fmt.Errorf("spec: command %q is not an absolute path", s.Command)
		}
		if s.Image != "" || len(s.Mounts) > 0 || s.Resources != nil {
			return errors.New("spec: a native instance has no image, mounts or container resources")
		}
		if len(s.Ports) != 1 {
			return fmt.Errorf("spec: a native instance listens on one port, not %d", len(s.Ports))
		}
		for i, e := range s.Env {
			if slices.Contains(reservedEnv, e.Name) {
				return fmt.Errorf("spec: env[%d]: %s is set by the native runtime", i, e.Name)
			}
		}
	default:
		return fmt.Errorf("spec: runtime %q is not docker or native", s.Runtime)
	}
	for i, e := range s.Env {
		if e.Name == "" || strings.ContainsAny(e.Name, "=\x00") {
			return fmt.Errorf("spec: env[%d]: bad name %q", i, e.Name)
		}
	}
	for i, m := range s.Mounts {
		if !path.IsAbs(m.HostPath) {
			return fmt.Errorf("spec: mounts[%d]: host path %q is not absolute", i, m.HostPath)
		}
		if !path.IsAbs(m.ContainerPath) {
			return fmt.Errorf("spec: mounts[%d]: container path %q is not absolute", i, m.ContainerPath)
		}
	}
	for i, p := range s.Ports {
		if p < 1 || p > 65535 {
			return fmt.Errorf("spec: ports[%d]: %d out of range", i, p)
		}
	}
	if r := s.Resources; r != nil {
		if _, err := r.deviceRequests(); err != nil {
			return fmt.Errorf("spec: resources: %w", err)
		}
		if r.ShmSize < 0 || r.Memory < 0 || r.NanoCPUs < 0 {
			return errors.New("spec: resources: a negative size or limit")
		}
	}
	return nil
}

// Hash is a digest of what runs (role, image, env, args, mounts, ports,
// runtime, command) — not of the identifiers (run, instance, attempt),
// which live in the resource's name and labels. Two specs with equal hashes
// yield interchangeable resources; a resource whose hash differs is stale.
// The digest of a given content never changes across versions: running
// containers carry it in their spec-hash label, and a new digest would make
// every one of them stale. So fields added later are left out of the digest
// while empty: a Docker spec hashes as it always did.
func (s ProvisionSpec) Hash() string {
	content := struct {
		Role    string   `json:"role"`
		Image   string   `json:"image"`
		Env     []EnvVar `json:"env"`
		Args    []string `json:"args"`
		Mounts  []Mount  `json:"mounts"`
		Ports   []int    `json:"ports"`
		Runtime string   `json:"runtime,omitempty"`
		Command string   `json:"command,omitempty"`
		// omitempty: specs without resources hash as before they existed.
		Resources *Resources `json:"resources,omitempty"`
	}{s.Role, s.Image, s.Env, s.Args, s.Mounts, s.Ports, s.Runtime, s.Command, s.Resources}
	b, err := json.Marshal(content)
	if err != nil {
		// Only strings, ints and bools: cannot fail.
		panic(fmt.Sprintf("provision: hash spec: %v", err))
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// Clone returns a deep copy.
func (s ProvisionSpec) Clone() ProvisionSpec {
	c := s
	c.Env = append([]EnvVar(nil), s.Env...)
	c.Args = append([]string(nil), s.Args...)
	c.Mounts = append([]Mount(nil), s.Mounts...)
	if s.Resources != nil {
		r := *s.Resources
		c.Resources = &r
	}
	c.Ports = append([]int(nil), s.Ports...)
	return c
}
