package demomodel

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// This file holds the allocation-free JSON reading and writing the hot path
// uses instead of encoding/json: the request body is validated once with
// json.Valid, then its top-level members are walked without decoding the
// ones we ignore (messages, tools, ...), and responses are appended into a
// pooled buffer.

// objIter walks the members of a JSON object. The data must be valid JSON
// (json.Valid); the iterator does not re-validate it.
type objIter struct {
	data []byte
	i    int
}

// newObjIter returns an iterator over the object in data, or false if data
// (valid JSON) is not an object.
func newObjIter(data []byte) (objIter, bool) {
	i := jsonskip.WS(data, 0)
	if i >= len(data) || data[i] != '{' {
		return objIter{}, false
	}
	return objIter{data: data, i: i + 1}, true
}

// next returns the next member: its key (raw, without quotes, still escaped)
// and its raw value.
func (it *objIter) next() (key, val []byte, ok bool) {
	d := it.data
	i := jsonskip.WS(d, it.i)
	if i < len(d) && d[i] == ',' {
		i = jsonskip.WS(d, i+1)
	}
	if i >= len(d) || d[i] != '"' {
		return nil, nil, false // '}'
	}
	kEnd := skipString(d, i)
	key = d[i+1 : kEnd-1]
	i = jsonskip.WS(d, kEnd) + 1 // ':'
	i = jsonskip.WS(d, i)
	vEnd := skipValue(d, i)
	it.i = vEnd
	return key, d[i:vEnd], true
}

// arrIter walks the elements of a JSON array (valid JSON, as objIter).
type arrIter struct {
	data []byte
	i    int
}

// newArrIter returns an iterator over the array in data, or false if data
// (valid JSON) is not an array.
func newArrIter(data []byte) (arrIter, bool) {
	i := jsonskip.WS(data, 0)
	if i >= len(data) || data[i] != '[' {
		return arrIter{}, false
	}
	return arrIter{data: data, i: i + 1}, true
}

// next returns the next element's raw value.
func (it *arrIter) next() (val []byte, ok bool) {
	d := it.data
	i := jsonskip.WS(d, it.i)
	if i < len(d) && d[i] == ',' {
		i = jsonskip.WS(d, i+1)
	}
	if i >= len(d) || d[i] == ']' {
		return nil, false
	}
	end := skipValue(d, i)
	it.i = end
	return d[i:end], true
}

// keyIs reports whether the raw key equals name, unescaping the key first in
// the rare case it contains escapes.
func keyIs(raw []byte, name string) bool {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw) == name
	}
	var s string
	q := make([]byte, 0, len(raw)+2)
	q = append(append(append(q, '"'), raw...), '"')
	return json.Unmarshal(q, &s) == nil && s == name
}

// skipString returns the index just past the string starting at d[i] == '"'
// (len(d) when it is not terminated; bodies are validated first).
func skipString(d []byte, i int) int {
	if e, ok := jsonskip.String(d, i); ok {
		return e
	}
	return len(d)
}

// skipValue returns the index just past the value starting at d[i] (len(d)
// when it is not closed).
func skipValue(d []byte, i int) int {
	if i >= len(d) {
		return i
	}
	if e, ok := jsonskip.Value(d, i); ok {
		return e
	}
	return len(d)
}

func isNull(v []byte) bool { return string(v) == "null" }

// stringValue returns the contents of a JSON string value, unescaped. ok is
// false if v is not a string.
func stringValue(v []byte) (s []byte, ok bool) {
	if len(v) < 2 || v[0] != '"' {
		return nil, false
	}
	inner := v[1 : len(v)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		return inner, true
	}
	var str string
	if json.Unmarshal(v, &str) != nil {
		return nil, false
	}
	return []byte(str), true
}

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
