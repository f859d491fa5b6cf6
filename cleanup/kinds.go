package cleanup

import (
	"encoding/json"
	"fmt"
	"slices"
)

// Kind is the kind of runtime binding a role's instance declares
// (roles.<role>.instance.runtime): the key site cleanups are selected by.
type Kind string

// The binding kinds this version knows.
const (
	// Docker: the instance is a container on this host's Docker engine.
	Docker Kind = "docker"
	// Native: the instance is a process the agent supervises.
	Native Kind = "native"
	// Simulated: the built-in demo model, served inside the agent. It
	// leaves nothing behind, so it selects no cleanup.
	Simulated Kind = "simulated"
)

// AllKinds is every binding kind: the selection for a site whose
// configuration cannot be read.
func AllKinds() KindSet { return NewKindSet(Docker, Native, Simulated) }

// ParseKind maps a runtime key as written in a configuration to its kind.
// The empty key is Docker, the configuration's default. Any other key this
// version does not know is an *UnknownBindingError: the resources such a
// binding may own cannot be classified, so no cleanup may proceed.
func ParseKind(key string) (Kind, error) {
	switch Kind(key) {
	case "":
		return Docker, nil
	case Docker, Native, Simulated:
		return Kind(key), nil
	}
	return "", &UnknownBindingError{Adapter: key}
}

// UnknownBindingError: an existing execution target binds a runtime adapter
// this version does not know, so the resources it may own cannot be
// classified. It is returned before any runtime is contacted.
type UnknownBindingError struct {
	// Adapter is the runtime key as written in the configuration, such as
	// "futureRuntime".
	Adapter string
}

func (e *UnknownBindingError) Error() string {
	return fmt.Sprintf("an execution target binds unknown runtime adapter %q, whose resources site cleanup cannot classify", e.Adapter)
}

// KindSet is a set of binding kinds. The zero value is empty and usable.
type KindSet struct{ m map[Kind]bool }

// NewKindSet returns the set of kinds.
func NewKindSet(kinds ...Kind) KindSet {
	s := KindSet{m: make(map[Kind]bool, len(kinds))}
	for _, k := range kinds {
		s.m[k] = true
	}
	return s
}

// Add puts k in the set.
func (s *KindSet) Add(k Kind) {
	if s.m == nil {
		s.m = map[Kind]bool{}
	}
	s.m[k] = true
}

// Has reports whether k is in the set.
func (s KindSet) Has(k Kind) bool { return s.m[k] }

// Kinds returns the members, sorted.
func (s KindSet) Kinds() []Kind {
	out := make([]Kind, 0, len(s.m))
	for k := range s.m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// MarshalJSON encodes the set as a sorted list.
func (s KindSet) MarshalJSON() ([]byte, error) { return json.Marshal(s.Kinds()) }
