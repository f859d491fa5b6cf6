package prompt

import (
	"bytes"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// This file holds the allocation-free JSON reading the tokenizer is built
// on, exported for the other hot-path readers of request bodies. The data
// must be valid JSON (jsonskip.Valid); nothing here validates it again.

// ObjectIter walks the members of a JSON object.
type ObjectIter struct {
	data []byte
	i    int
}

// NewObjectIter returns an iterator over the object in data, or false if
// data (valid JSON) is not an object.
func NewObjectIter(data []byte) (ObjectIter, bool) {
	i := jsonskip.WS(data, 0)
	if i >= len(data) || data[i] != '{' {
		return ObjectIter{}, false
	}
	return ObjectIter{data: data, i: i + 1}, true
}

// Next returns the next member: its key (raw, without quotes, still
// escaped: compare it with KeyIs) and its raw value. ok is false after the
// last member.
func (it *ObjectIter) Next() (key, val []byte, ok bool) {
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

// ArrayIter walks the elements of a JSON array.
type ArrayIter struct {
	data []byte
	i    int
}

// NewArrayIter returns an iterator over the array in data, or false if
// data (valid JSON) is not an array.
func NewArrayIter(data []byte) (ArrayIter, bool) {
	i := jsonskip.WS(data, 0)
	if i >= len(data) || data[i] != '[' {
		return ArrayIter{}, false
	}
	return ArrayIter{data: data, i: i + 1}, true
}

// Next returns the next element's raw value; ok is false after the last.
func (it *ArrayIter) Next() (val []byte, ok bool) {
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

// skipString returns the index just past the string starting at
// d[i] == '"' (len(d) when it is not terminated).
func skipString(d []byte, i int) int {
	if e, ok := jsonskip.String(d, i); ok {
		return e
	}
	return len(d)
}

// skipValue returns the index just past the value starting at d[i]
// (len(d) when it is not closed).
func skipValue(d []byte, i int) int {
	if i >= len(d) {
		return i
	}
	if e, ok := jsonskip.Value(d, i); ok {
		return e
	}
	return len(d)
}

// KeyIs reports whether the raw key (as ObjectIter.Next returns it) reads
// as name, unescaping it first in the rare case it has escapes.
func KeyIs(raw []byte, name string) bool {
	r := newStringReader(raw)
	if !r.escaped {
		return string(raw) == name
	}
	for {
		p, ok := r.next()
		if !ok {
			return name == ""
		}
		if len(p) > len(name) || string(p) != name[:len(p)] {
			return false
		}
		name = name[len(p):]
	}
}

// StringValue returns the value of the JSON string v, read as the package
// doc's "Strings" says: its bytes between the quotes when it has no
// escapes (no copy), else a copy decoded as encoding/json does. ok is
// false if v is not a string.
func StringValue(v []byte) (s []byte, ok bool) {
	if len(v) < 2 || v[0] != '"' {
		return nil, false
	}
	r := newStringReader(v[1 : len(v)-1])
	if !r.escaped {
		return r.s, true
	}
	s = make([]byte, 0, len(r.s))
	for {
		p, ok := r.next()
		if !ok {
			return s, true
		}
		s = append(s, p...)
	}
}

// replacement is U+FFFD, which stands for an invalid UTF-8 byte or a lone
// surrogate in an escaped string.
var replacement = []byte(string(unicode.ReplacementChar))

// stringReader yields the value of a JSON string in pieces, without
// copying: runs of the literal that need no decoding, and each decoded
// escape or replacement.
type stringReader struct {
	s       []byte // the literal's bytes between the quotes
	i       int
	escaped bool // s has a backslash: decode it as encoding/json does
	invalid int  // s[:invalid] may hold invalid UTF-8 still to replace
	buf     [utf8.UTFMax]byte
}

func newStringReader(s []byte) stringReader {
	return stringReader{s: s, escaped: bytes.IndexByte(s, '\\') >= 0}
}

// next returns the next piece of the value; ok is false at its end. A
// piece may point into the reader, so it is valid until the next call.
func (r *stringReader) next() (p []byte, ok bool) {
	s, i := r.s, r.i
	if i >= len(s) {
		return nil, false
	}
	if !r.escaped {
		r.i = len(s)
		return s, true
	}
	if s[i] == '\\' {
		return r.escape()
	}
	end := len(s)
	if j := bytes.IndexByte(s[i:], '\\'); j >= 0 {
		end = i + j
	}
	if i >= r.invalid {
		if utf8.Valid(s[i:end]) {
			r.i = end
			return s[i:end], true
		}
		r.invalid = end // walk this run a rune at a time
	}
	j := i
	for j < end {
		if s[j] < utf8.RuneSelf {
			j++
			continue
		}
		rr, size := utf8.DecodeRune(s[j:end])
		if rr == utf8.RuneError && size == 1 {
			break
		}
		j += size
	}
	if j == i { // an invalid UTF-8 byte
		r.i = i + 1
		return replacement, true
	}
	r.i = j
	return s[i:j], true
}

// escape decodes the escape at s[r.i] == '\\'; valid JSON has one of
// these after the backslash.
func (r *stringReader) escape() ([]byte, bool) {
	s, i := r.s, r.i
	var c byte
	switch s[i+1] {
	case 'b':
		c = '\b'
	case 'f':
		c = '\f'
	case 'n':
		c = '\n'
	case 'r':
		c = '\r'
	case 't':
		c = '\t'
	case 'u':
		rr := getu4(s[i:])
		i += 6
		if utf16.IsSurrogate(rr) {
			if dec := utf16.DecodeRune(rr, getu4(s[i:])); dec != unicode.ReplacementChar {
				rr = dec
				i += 6
			} else {
				rr = unicode.ReplacementChar
			}
		}
		r.i = i
		return r.buf[:utf8.EncodeRune(r.buf[:], rr)], true
	default: // '"', '\\', '/'
		c = s[i+1]
	}
	r.i = i + 2
	r.buf[0] = c
	return r.buf[:1], true
}

// getu4 decodes the \uXXXX escape at the start of s, or returns -1.
func getu4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	var r rune
	for _, c := range s[2:6] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r<<4 | rune(c)
	}
	return r
}
