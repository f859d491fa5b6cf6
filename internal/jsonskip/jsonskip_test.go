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

// refString is the byte-at-a-time String the fast one is held to; it returns the index just past the string literal starting at
// b[i] == '"'; ok is false when it is not terminated.
func refString(b []byte, i int) (int, bool) {
	i++
	for i < len(b) {
		switch b[i] {
		case '\\':
			i += 2
		case '"':
			return i + 1, true
		default:
			i++
		}
	}
	return 0, false
}

// refValue is the switch-per-byte Value the fast one is held to; it returns the index just past the JSON value starting at b[i]; ok is
// false when i is out of range or a string, object or array is not closed.
// Scalars end at the next delimiter or whitespace.
func refValue(b []byte, i int) (int, bool) {
	if i >= len(b) {
		return 0, false
	}
	switch b[i] {
	case '"':
		return refString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				e, ok := refString(b, i)
				if !ok {
					return 0, false
				}
				i = e
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1, true
				}
			}
			i++
		}
		return 0, false
	default:
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i, true
			}
			i++
		}
		return i, true
	}
}

// FuzzValue holds Value and String to the byte-at-a-time reference.
func FuzzValue(f *testing.F) {
	for _, s := range []string{`"a\\"b",`, `{"x":[1,"}"]} `, `[1,[2,[3]]]`, `"\\\\"`, `"\\\\\\"x"`, `{"a":"b\\"}`, `"\\`, `{"id":"x","choices":[{"m":{"c":"d"}}],"u":{"p":8}}`} {
		f.Add([]byte(s), 0)
	}
	f.Fuzz(func(t *testing.T, b []byte, i int) {
		if i < 0 || i > len(b) {
			return
		}
		e1, ok1 := Value(b, i)
		e2, ok2 := refValue(b, i)
		if e1 != e2 || ok1 != ok2 {
			t.Fatalf("Value(%q, %d) = %d, %v; reference %d, %v", b, i, e1, ok1, e2, ok2)
		}
		if i < len(b) && b[i] == '"' {
			e1, ok1 = String(b, i)
			e2, ok2 = refString(b, i)
			if e1 != e2 || ok1 != ok2 {
				t.Fatalf("String(%q, %d) = %d, %v; reference %d, %v", b, i, e1, ok1, e2, ok2)
			}
		}
	})
}
