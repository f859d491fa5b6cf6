package proxy

import "testing"

// forwardable's switch must name every hop-by-hop header.
func TestForwardableDropsHopHeaders(t *testing.T) {
	for _, h := range hopHeaders {
		for _, mesh := range []bool{false, true} {
			if forwardable(h, nil, mesh) {
				t.Errorf("forwardable(%q, mesh=%v) = true", h, mesh)
			}
		}
	}
	if !forwardable("Accept", nil, true) || !forwardable("X-Custom", nil, false) {
		t.Error("an end-to-end header is not forwardable")
	}
	if forwardable("X-Custom", []string{"X-Custom"}, false) {
		t.Error("a header the Connection header names is forwardable")
	}
}
