package agent

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/docker/go-units"
	"go.yaml.in/yaml/v3"
)

// GPUs is an instance's GPU request as docker run --gpus takes it: all, a
// count, or a list of device indexes or UUIDs. Its text form is provision
// Resources.GPUs: "all", "2" or "0,1".
type GPUs string

// UnmarshalYAML accepts `all`, a number, or a list of ids.
func (g *GPUs) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		v := strings.TrimSpace(n.Value)
		if v != "all" && v != "" {
			if c, err := strconv.Atoi(v); err != nil || c < 1 {
				return fmt.Errorf("line %d: gpus %q is not all, a count or a list of device ids", n.Line, n.Value)
			}
		}
		*g = GPUs(v)
	case yaml.SequenceNode:
		ids := make([]string, 0, len(n.Content))
		for _, c := range n.Content {
			id := strings.TrimSpace(c.Value)
			if c.Kind != yaml.ScalarNode || id == "" || strings.Contains(id, ",") {
				return fmt.Errorf("line %d: gpus: %q is not a device id", c.Line, c.Value)
			}
			ids = append(ids, id)
		}
		if len(ids) == 0 {
			return fmt.Errorf("line %d: gpus: an empty list (omit gpus for none)", n.Line)
		}
		*g = GPUs(strings.Join(ids, ","))
	default:
		return fmt.Errorf("line %d: gpus is not all, a count or a list of device ids", n.Line)
	}
	return nil
}

// ByteSize is a size in bytes written as a number of bytes or with a unit
// (512m, 8g, 16GiB: binary units, as docker run's --shm-size and --memory).
type ByteSize int64

// UnmarshalYAML parses a size.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("line %d: %q is not a size", n.Line, n.Value)
	}
	v, err := units.RAMInBytes(strings.TrimSpace(n.Value))
	if err != nil || v < 0 {
		return fmt.Errorf("line %d: %q is not a size (e.g. 512m, 8g)", n.Line, n.Value)
	}
	*b = ByteSize(v)
	return nil
}
