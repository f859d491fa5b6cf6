package agent

import (
	"errors"
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
				return fmt.Errorf("%q is not all, a count or a list of device ids", n.Value)
			}
		}
		*g = GPUs(v)
	case yaml.SequenceNode:
		ids := make([]string, 0, len(n.Content))
		for i, c := range n.Content {
			id := strings.TrimSpace(c.Value)
			if c.Kind != yaml.ScalarNode || id == "" || strings.Contains(id, ",") {
				return fmt.Errorf("%q (item %d) is not a device id", c.Value, i)
			}
			ids = append(ids, id)
		}
		if len(ids) == 0 {
			return errors.New("an empty list (omit gpus for none)")
		}
		*g = GPUs(strings.Join(ids, ","))
	default:
		return errors.New("want all, a count or a list of device ids")
	}
	return nil
}

// ByteSize is a size in bytes written as a number of bytes or with a unit
// (512m, 8g, 16GiB: binary units, as docker run's --shm-size and --memory).
type ByteSize int64

// UnmarshalYAML parses a size.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return errors.New("want a size (e.g. 512m, 8g), not a section or a list")
	}
	v, err := units.RAMInBytes(strings.TrimSpace(n.Value))
	if err != nil || v < 0 {
		return fmt.Errorf("%q is not a size (e.g. 512m, 8g)", n.Value)
	}
	*b = ByteSize(v)
	return nil
}
