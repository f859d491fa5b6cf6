package defaults

import (
	"testing"
	"time"
)

func TestPositive(t *testing.T) {
	tests := []struct {
		name string
		v    time.Duration
		want time.Duration
	}{
		{"zero takes the default", 0, time.Second},
		{"negative takes the default", -time.Minute, time.Second},
		{"positive is kept", 3 * time.Millisecond, 3 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := tt.v
			Positive(&v, time.Second)
			if v != tt.want {
				t.Errorf("Positive(%v, 1s) = %v, want %v", tt.v, v, tt.want)
			}
		})
	}
	n := -1
	Positive(&n, 5)
	if n != 5 {
		t.Errorf("Positive(-1, 5) = %d, want 5", n)
	}
}

func TestZero(t *testing.T) {
	for _, tt := range []struct{ v, want string }{{"", "docker"}, {"native", "native"}} {
		v := tt.v
		Zero(&v, "docker")
		if v != tt.want {
			t.Errorf("Zero(%q, docker) = %q, want %q", tt.v, v, tt.want)
		}
	}
}
