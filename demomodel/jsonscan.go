package demomodel

import (
	"unicode/utf8"

	"github.com/infermesh/infermesh/internal/jsonskip"
	"github.com/infermesh/infermesh/internal/prompt"
)

// This file holds the allocation-free JSON reading and writing the hot path
// uses instead of encoding/json: the request body is validated once with
// jsonskip.Valid, then its top-level members are walked (internal/prompt's
// iterators) without decoding the ones we ignore (messages, tools, ...),
// and responses are appended into a pooled buffer.

// objIter walks the members of a JSON object (valid JSON).
type objIter struct{ prompt.ObjectIter }

// newObjIter returns an iterator over the object in data, or false if data
// (valid JSON) is not an object.
func newObjIter(data []byte) (objIter, bool) {
	it, ok := prompt.NewObjectIter(data)
	return objIter{it}, ok
}

// next returns the next member: its key (raw, without quotes, still escaped)
// and its raw value.
func (it *objIter) next() (key, val []byte, ok bool) { return it.Next() }

// keyIs reports whether the raw key reads as name.
func keyIs(raw []byte, name string) bool { return prompt.KeyIs(raw, name) }

// stringValue returns the contents of a JSON string value, unescaped. ok is
// false if v is not a string.
func stringValue(v []byte) (s []byte, ok bool) { return prompt.StringValue(v) }

func isNull(v []byte) bool { return string(v) == "null" }

// boolValue parses true or false.
func boolValue(v []byte) (b, ok bool) {
	switch string(v) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// intValue parses a JSON integer (an integral number such as 16 or 16.0 is
// accepted too, as OpenAI does), clamping to ±1<<40 so callers need not fear
// overflow.
func intValue(v []byte) (n int64, ok bool) {
	const clamp = 1 << 40
	i := 0
	neg := false
	if i < len(v) && v[i] == '-' {
		neg = true
		i++
	}
	if i >= len(v) {
		return 0, false
	}
	digits := 0
	for ; i < len(v) && v[i] >= '0' && v[i] <= '9'; i++ {
		if n < clamp {
			n = n*10 + int64(v[i]-'0')
		}
		digits++
	}
	if digits == 0 {
		return 0, false
	}
	if i < len(v) && v[i] == '.' { // fraction must be all zeros
		i++
		for ; i < len(v) && v[i] == '0'; i++ {
		}
	}
	if i != len(v) {
		return 0, false
	}
	if n > clamp {
		n = clamp
	}
	if neg {
		n = -n
	}
	return n, true
}

// isNonEmptyArray reports whether v is a JSON array with at least one element.
func isNonEmptyArray(v []byte) bool {
	if len(v) < 2 || v[0] != '[' {
		return false
	}
	i := jsonskip.WS(v, 1)
	return i < len(v) && v[i] != ']'
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string literal. Invalid UTF-8 becomes
// U+FFFD, as encoding/json does.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
