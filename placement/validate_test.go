package placement

import (
	"errors"
	"strings"
	"testing"
)

func TestValidateRole(t *testing.T) {
	tests := []struct {
		role string
		ok   bool
	}{
		{"chat", true},
		{"Chat-2_x.v1", true},
		{strings.Repeat("a", MaxRoleLen), true},
		{strings.Repeat("a", MaxRoleLen+1), false},
		{"", false},
		{".", false},
		{"..", false},
		{"a/b", false},
		{"../etc", false},
		{"chat role", false},
		{"chat\n", false},
		{"chät", false},
		{"a:b", false},
		{"a%2Fb", false},
	}
	for _, tt := range tests {
		t.Run(tt.role, func(t *testing.T) {
			err := ValidateRole(tt.role)
			if got := err == nil; got != tt.ok {
				t.Fatalf("ValidateRole(%q) = %v, want ok=%v", tt.role, err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrBadRole) {
				t.Errorf("ValidateRole(%q) = %v, want wrapping ErrBadRole", tt.role, err)
			}
		})
	}
}

func TestParseLoopbackBase(t *testing.T) {
	tests := []struct {
		in   string
		want string // "" = refused
	}{
		{"http://127.0.0.1:8080", "http://127.0.0.1:8080"},
		{"http://127.0.0.1:8080/", "http://127.0.0.1:8080"},
		{"http://127.1.2.3:1", "http://127.1.2.3:1"},
		{"http://127.255.255.255:65535", "http://127.255.255.255:65535"},
		{"http://[::1]:8080", "http://[::1]:8080"},
		{"http://[::1]:8080/", "http://[::1]:8080"},
		{"http://[0:0:0:0:0:0:0:1]:8080", "http://[::1]:8080"},
		{"http://localhost:8080", "http://localhost:8080"},
		{"http://LocalHost:8080/", "http://localhost:8080"},
		{"HTTP://127.0.0.1:8080", "http://127.0.0.1:8080"},
		{"http://127.0.0.1:08080", "http://127.0.0.1:8080"},
		// refused
		{"https://127.0.0.1:8080", ""},
		{"ftp://127.0.0.1:8080", ""},
		{"127.0.0.1:8080", ""},
		{"//127.0.0.1:8080", ""},
		{"http://127.0.0.1", ""},
		{"http://127.0.0.1:", ""},
		{"http://127.0.0.1:0", ""},
		{"http://127.0.0.1:65536", ""},
		{"http://127.0.0.1:http", ""},
		{"http://10.0.0.1:8080", ""},
		{"http://0.0.0.0:8080", ""},
		{"http://128.0.0.1:8080", ""},
		{"http://192.168.1.1:8080", ""},
		{"http://[::]:8080", ""},
		{"http://[::2]:8080", ""},
		{"http://[::ffff:127.0.0.1]:8080", ""},
		{"http://[::1%25lo]:8080", ""},
		{"http://::1:8080", ""},
		{"http://example.com:8080", ""},
		{"http://localhost.:8080", ""},
		{"http://localhost.example.com:8080", ""},
		{"http://127.0.0.1.nip.io:8080", ""},
		{"http://2130706433:8080", ""},
		{"http://0x7f.0.0.1:8080", ""},
		{"http://127.1:8080", ""},
		{"http://127.0.0.1:8080/v1", ""},
		{"http://127.0.0.1:8080//", ""},
		{"http://127.0.0.1:8080/%2F", ""},
		{"http://127.0.0.1:8080?x=1", ""},
		{"http://127.0.0.1:8080/?", ""},
		{"http://127.0.0.1:8080#frag", ""},
		{"http://127.0.0.1:8080/#", ""},
		{"http://user@127.0.0.1:8080", ""},
		{"http://user:pw@127.0.0.1:8080", ""},
		{"http://evil.com@127.0.0.1:8080", ""},
		{"http://127.0.0.1:8080@evil.com:80", ""},
		{" http://127.0.0.1:8080", ""},
		{"http://127.0.0.1:8080 ", ""},
		{"http:127.0.0.1:8080", ""},
		{"", ""},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseLoopbackBase(tt.in)
			if tt.want == "" {
				if err == nil {
					t.Fatalf("ParseLoopbackBase(%q) = %q, want error", tt.in, got)
				}
				if !errors.Is(err, ErrBadBase) {
					t.Errorf("ParseLoopbackBase(%q) error %v, want wrapping ErrBadBase", tt.in, err)
				}
				if IsLoopbackBase(tt.in) {
					t.Errorf("IsLoopbackBase(%q) = true, want false", tt.in)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseLoopbackBase(%q) = %q, %v; want %q, nil", tt.in, got, err, tt.want)
			}
			if !IsLoopbackBase(tt.in) {
				t.Errorf("IsLoopbackBase(%q) = false, want true", tt.in)
			}
			// Canonical form is a fixed point.
			if again, err := ParseLoopbackBase(got); err != nil || again != got {
				t.Errorf("ParseLoopbackBase(%q) = %q, %v; want it unchanged", got, again, err)
			}
		})
	}
}

func TestLoopbackProxyBase(t *testing.T) {
	if got, want := LoopbackProxyBase(18080), "http://127.0.0.1:18080/v1"; got != want {
		t.Errorf("LoopbackProxyBase(18080) = %q, want %q", got, want)
	}
}

func TestAdvertRole(t *testing.T) {
	tests := []struct{ name, want string }{
		{"infer.chat", "chat"},
		{"infer.", ""},
		{"chat", ""},
		{"infer", ""},
		{"xinfer.chat", ""},
	}
	for _, tt := range tests {
		if got := (Advert{Name: tt.name}).Role(); got != tt.want {
			t.Errorf("Advert{Name: %q}.Role() = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestKindString(t *testing.T) {
	for k, want := range map[Kind]string{KindLocal: "local", KindRemote: "remote", 0: "Kind(0)"} {
		if got := k.String(); got != want {
			t.Errorf("Kind(%d).String() = %q, want %q", uint8(k), got, want)
		}
	}
}
