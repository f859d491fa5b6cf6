package cleanup

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/infermesh/infermesh/identity"
)

// Scope says which of a site's runtime resources one cleanup acts on. The
// zero value is the whole site.
type Scope struct {
	targets []string // sorted, distinct; nil: the whole site
}

// SiteScope is every resource labelled with the site on this host,
// whichever node created it: what site reset and site deletion remove.
func SiteScope() Scope { return Scope{} }

// TargetScope is only the site's resources whose execution-target label
// names one of targets (node names): what a node leaving its site removes.
// Resources of another well-formed target are left alone; a site resource
// whose target label is missing or malformed fails the cleanup
// (ErrUnattributable), because it cannot be attributed.
func TargetScope(targets ...string) (Scope, error) {
	if len(targets) == 0 {
		return Scope{}, errors.New("scope: no execution target named")
	}
	seen := make([]string, 0, len(targets))
	for _, t := range targets {
		if err := identity.ValidateNodeName(t); err != nil {
			return Scope{}, fmt.Errorf("scope: execution target: %w", err)
		}
		if !slices.Contains(seen, t) {
			seen = append(seen, t)
		}
	}
	slices.Sort(seen)
	return Scope{targets: seen}, nil
}

// IsSite reports whether the scope is the whole site.
func (s Scope) IsSite() bool { return s.targets == nil }

// Targets returns the named execution targets (nil for the whole site).
func (s Scope) Targets() []string { return slices.Clone(s.targets) }

// Includes reports whether a resource of the site attributed to target is
// in scope.
func (s Scope) Includes(target string) bool {
	return s.IsSite() || slices.Contains(s.targets, target)
}

// String is "site" or "targets a,b".
func (s Scope) String() string {
	if s.IsSite() {
		return "site"
	}
	return "targets " + strings.Join(s.targets, ",")
}

// MarshalJSON encodes {"kind":"site"} or {"kind":"targets","targets":[...]}.
func (s Scope) MarshalJSON() ([]byte, error) {
	if s.IsSite() {
		return json.Marshal(map[string]string{"kind": "site"})
	}
	return json.Marshal(struct {
		Kind    string   `json:"kind"`
		Targets []string `json:"targets"`
	}{"targets", s.targets})
}
