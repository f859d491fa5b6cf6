package routing_test

import (
	"strings"
	"testing"

	"github.com/infermesh/infermesh/routing"
)

func TestParsePolicy(t *testing.T) {
	for _, tt := range []struct {
		name string
		p    routing.Policy
	}{
		{"auto", routing.PolicyAuto},
		{"local-first", routing.PolicyLocalFirst},
		{"least-loaded", routing.PolicyLeastLoaded},
	} {
		if s := tt.p.String(); s != tt.name {
			t.Errorf("%d.String() = %q, want %q", tt.p, s, tt.name)
		}
		if p, err := routing.ParsePolicy(tt.name); err != nil || p != tt.p {
			t.Errorf("ParsePolicy(%q) = %v, %v", tt.name, p, err)
		}
	}
	var zero routing.Policy
	if zero != routing.PolicyAuto {
		t.Error("the zero policy is not auto")
	}
	for _, s := range []string{"fastest", "Auto", "local_first", " auto", "", "Policy(7)", routing.Policy(7).String()} {
		p, err := routing.ParsePolicy(s)
		if err == nil {
			t.Errorf("ParsePolicy(%q) = %v, want an error", s, p)
			continue
		}
		if !strings.Contains(err.Error(), `"`+s+`"`) {
			t.Errorf("ParsePolicy(%q): error %q does not name the value", s, err)
		}
	}
	if s := routing.Policy(7).String(); s != "Policy(7)" {
		t.Errorf("Policy(7).String() = %q", s)
	}
}

func TestReasonsListed(t *testing.T) {
	seen := map[routing.Reason]bool{}
	for _, r := range routing.Reasons() {
		if r == "" || seen[r] {
			t.Errorf("reason %q empty or repeated", r)
		}
		seen[r] = true
	}
	if len(seen) != 9 {
		t.Errorf("%d reasons", len(seen))
	}
}
