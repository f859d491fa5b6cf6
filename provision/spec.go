package provision

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"strings"
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
	// Ports are container TCP ports published on the host's loopback only.
	Ports []int `json:"ports,omitempty"`
}

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
	if strings.TrimSpace(s.Image) == "" {
		return errors.New("spec: image is empty")
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
	return nil
}

// Hash is a digest of what runs (role, image, env, args, mounts, ports) —
// not of the identifiers (run, instance, attempt), which live in the
// resource's name and labels. Two specs with equal hashes yield
// interchangeable containers; a resource whose hash differs is stale. The
// digest of a given content never changes across versions: running
// containers carry it in their spec-hash label, and a new digest would make
// every one of them stale.
func (s ProvisionSpec) Hash() string {
	content := struct {
		Role   string   `json:"role"`
		Image  string   `json:"image"`
		Env    []EnvVar `json:"env"`
		Args   []string `json:"args"`
		Mounts []Mount  `json:"mounts"`
		Ports  []int    `json:"ports"`
	}{s.Role, s.Image, s.Env, s.Args, s.Mounts, s.Ports}
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
	c.Ports = append([]int(nil), s.Ports...)
	return c
}
