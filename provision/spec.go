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

// NodeSpec describes one node attempt a provider acquires. It is the durable
// intent written before a resource is created, so it must JSON round-trip;
// specs written by older versions (without mounts, attempt id, role or
// ports) decode with zero values for those fields.
type NodeSpec struct {
	RunID  uint64 `json:"run_id"`
	NodeID uint64 `json:"node_id"`
	// AttemptID is the concrete attempt. Zero is reserved for an unbound
	// template: providers refuse to create a resource for it.
	AttemptID  uint64   `json:"attempt_id"`
	StageIndex *uint32  `json:"stage_index"`
	Image      string   `json:"image"`
	Env        []EnvVar `json:"env"`
	Args       []string `json:"args"`
	Mounts     []Mount  `json:"mounts,omitempty"`
	// Role is the infermesh role an instance serves ("" for bootstrap nodes).
	Role string `json:"role,omitempty"`
	// Ports are container TCP ports published on the host's loopback only.
	Ports []int `json:"ports,omitempty"`
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

// Mount is a host path bind-mounted into the node.
type Mount struct {
	HostPath      string `json:"host_path"`
	ContainerPath string `json:"container_path"`
	ReadOnly      bool   `json:"readonly"`
}

// ErrTemplateSpec is returned when asked to create a resource for a spec
// whose AttemptID is 0 (an unbound template).
var ErrTemplateSpec = errors.New("spec is an unbound template (attempt id 0)")

// Validate checks the fields every provider relies on.
func (s NodeSpec) Validate() error {
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
// not of the identifiers (run, node, attempt, stage), which live in the
// resource's name and labels. Two specs with equal hashes yield
// interchangeable containers; a resource whose hash differs is stale.
func (s NodeSpec) Hash() string {
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
func (s NodeSpec) Clone() NodeSpec {
	c := s
	if s.StageIndex != nil {
		v := *s.StageIndex
		c.StageIndex = &v
	}
	c.Env = append([]EnvVar(nil), s.Env...)
	c.Args = append([]string(nil), s.Args...)
	c.Mounts = append([]Mount(nil), s.Mounts...)
	c.Ports = append([]int(nil), s.Ports...)
	return c
}
