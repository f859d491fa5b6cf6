// Package jsonskip steps over JSON tokens without decoding them: the few
// scanning primitives the proxy (to find and rewrite the top-level model)
// and the demo model (to read only the request fields it needs) share on
// their hot paths. They do not validate; callers validate first or treat a
// false ok as malformed input.
package jsonskip

import "bytes"

// WS returns the index of the first non-whitespace byte at or after i.
func WS(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// String returns the index just past the string literal starting at
// b[i] == '"'; ok is false when it is not terminated. It jumps from quote
// to quote (bytes.IndexByte) and counts the backslashes before each: an
// odd run escapes it.
func String(b []byte, i int) (int, bool) {
	i++
	for i < len(b) {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return 0, false
		}
		q := i + j
		n := 0
		for k := q - 1; k >= i && b[k] == '\\'; k-- {
			n++
		}
		if n%2 == 0 {
			return q + 1, true
		}
		i = q + 1
	}
	return 0, false
}

// inContainer marks the bytes Value must look at inside an object or
// array; it steps over the rest a byte at a time without a switch.
var inContainer = [256]bool{'"': true, '{': true, '[': true, '}': true, ']': true}

// Value returns the index just past the JSON value starting at b[i]; ok is
// false when i is out of range or a string, object or array is not closed.
// Scalars end at the next delimiter or whitespace.
func Value(b []byte, i int) (int, bool) {
	if i >= len(b) {
		return 0, false
	}
	switch b[i] {
	case '"':
		return String(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				e, ok := String(b, i)
				if !ok {
					return 0, false
				}
				i = e
			case '{', '[':
				depth++
				i++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1, true
				}
				i++
			default:
				i++
			}
			for i < len(b) && !inContainer[b[i]] {
				i++
			}
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
