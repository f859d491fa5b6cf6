package cleanup

import (
	"encoding/json"
	"time"
)

// Resource is one runtime resource a site owns, as a read-only pass found
// it, described for the operator.
type Resource struct {
	// Runtime is the human-readable runtime name, such as "Docker runtime".
	Runtime string `json:"runtime"`
	// Description is the operator-facing line: what it is, its name, role,
	// node, attempt and state.
	Description string `json:"description"`

	// Ref is the resource's stable name (a container name, a workload's
	// ref); ID is the runtime's own id for it (a container id, a pid).
	Ref string `json:"ref"`
	ID  string `json:"id,omitempty"`
	// Role, Target (the execution target: the node it is attributed to)
	// and Attempt are its owner identity; State is the runtime's word for
	// where it is (running, exited, ...).
	Role    string `json:"role,omitempty"`
	Target  string `json:"target"`
	Attempt uint64 `json:"attempt,omitempty"`
	State   string `json:"state,omitempty"`
	// Created is when the runtime created it; zero when unknown.
	Created time.Time `json:"created,omitzero"`
	// Location is where the resource's record lives, when it has one (a
	// native workload's record file).
	Location string `json:"location,omitempty"`
}

// Skipped is an optional runtime whose control plane was unreachable, so it
// was neither inventoried nor cleaned.
type Skipped struct {
	// Runtime is the human-readable runtime name.
	Runtime string
	// Reason is the connection failure.
	Reason error
}

// MarshalJSON encodes {"runtime": ..., "reason": "..."}.
func (s Skipped) MarshalJSON() ([]byte, error) {
	reason := ""
	if s.Reason != nil {
		reason = s.Reason.Error()
	}
	return json.Marshal(struct {
		Runtime string `json:"runtime"`
		Reason  string `json:"reason"`
	}{s.Runtime, reason})
}

// Inventory is what a read-only pass found.
type Inventory struct {
	// Resources a cleanup would remove, grouped by runtime in discovery
	// order.
	Resources []Resource `json:"resources"`
	// Skipped optional runtimes.
	Skipped []Skipped `json:"skipped"`
}

// Report is the outcome of a cleanup.
type Report struct {
	// Removed are the resources that were present and are now absent, in
	// the order they were removed.
	Removed []Resource `json:"removed"`
	// Kept are resources a sweep found and left: still wanted, or younger
	// than its grace period. A cleanup keeps nothing.
	Kept []Resource `json:"kept,omitempty"`
	// Skipped optional runtimes.
	Skipped []Skipped `json:"skipped"`
}
