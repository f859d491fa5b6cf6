package jsonskip

import "testing"

func TestValue(t *testing.T) {
	tests := []struct {
		in     string
		end    int
		wantOK bool
	}{
		{`"a\"b",`, 6, true},
		{`{"x":[1,"}"]} `, 13, true},
		{`[1,[2,[3]]]`, 11, true},
		{`true,`, 4, true},
		{`-1.5e3}`, 6, true},
		{`"open`, 0, false},
		{`{"a":1`, 0, false},
		{``, 0, false},
	}
	for _, tt := range tests {
		end, ok := Value([]byte(tt.in), 0)
		if end != tt.end || ok != tt.wantOK {
			t.Errorf("Value(%q) = %d, %v; want %d, %v", tt.in, end, ok, tt.end, tt.wantOK)
		}
	}
	if got := WS([]byte(" \t\n\rx"), 0); got != 4 {
		t.Errorf("WS = %d, want 4", got)
	}
}
