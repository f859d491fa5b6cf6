package proxy

import (
	"encoding/json"
	"errors"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// The errors of modelSpan and bodyModel.
var (
	errNotObject      = errors.New("body is not a JSON object")
	errModelDuplicate = errors.New(`duplicate "model" key`)
	errModelNotString = errors.New(`"model" is not a string`)
)

// bodyModel is modelSpan's answer for a request body, from the member
// readBody found while validating it (one pass over the body).
func bodyModel(m jsonskip.Member) (start, end int, found bool, err error) {
	switch m.Err {
	case jsonskip.MemberNotObject:
		return 0, 0, false, errNotObject
	case jsonskip.MemberDuplicate:
		return 0, 0, false, errModelDuplicate
	case jsonskip.MemberNotString:
		return 0, 0, false, errModelNotString
	}
	return m.Start, m.End, m.Found, nil
}

// modelSpan locates the string value of the top-level "model" key of the JSON
// object in b without decoding the rest of the document. start and end delimit
// the value including its quotes. found is false when the object has no
// top-level "model" key; an error is returned when b is not an object, the
// model value is not a string, or the key appears twice.
//
// It assumes b is valid JSON (request bodies take bodyModel instead, from
// their validation; this is the best-effort scan of an upstream's output or
// of a body already checked); on malformed input it reports an error rather
// than panicking.
func modelSpan(b []byte) (start, end int, found bool, err error) {
	i := jsonskip.WS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return 0, 0, false, errNotObject
	}
	i++
	for {
		i = jsonskip.WS(b, i)
		if i >= len(b) {
			return 0, 0, false, errNotObject
		}
		if b[i] == '}' {
			return start, end, found, nil
		}
		if b[i] == ',' {
			i++
			continue
		}
		if b[i] != '"' {
			return 0, 0, false, errNotObject
		}
		ks := i
		ke, ok := jsonskip.String(b, i)
		if !ok {
			return 0, 0, false, errNotObject
		}
		key := b[ks+1 : ke-1]
		i = jsonskip.WS(b, ke)
		if i >= len(b) || b[i] != ':' {
			return 0, 0, false, errNotObject
		}
		i = jsonskip.WS(b, i+1)
		if i >= len(b) {
			return 0, 0, false, errNotObject
		}
		if string(key) == "model" {
			if found {
				// Parsers disagree on which duplicate wins; pinning must
				// not be bypassable, so duplicates are refused.
				return 0, 0, false, errModelDuplicate
			}
			if b[i] != '"' {
				return 0, 0, false, errModelNotString
			}
			ve, ok := jsonskip.String(b, i)
			if !ok {
				return 0, 0, false, errNotObject
			}
			start, end, found = i, ve, true
			i = ve
			continue
		}
		ve, ok := jsonskip.Value(b, i)
		if !ok {
			return 0, 0, false, errNotObject
		}
		i = ve
	}
}

// decodeModel returns the Go string of a JSON string literal span.
func decodeModel(lit []byte) string {
	for _, c := range lit[1 : len(lit)-1] {
		if c == '\\' {
			var s string
			if json.Unmarshal(lit, &s) == nil {
				return s
			}
			break
		}
	}
	return string(lit[1 : len(lit)-1])
}

// appendJSONString appends s as a JSON string literal.
func appendJSONString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c == '"' || c == '\\' || c >= 0x80 {
			q, _ := json.Marshal(s)
			return append(dst, q...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// replaceSpan returns b with b[start:end] replaced by repl, reusing b's
// storage when repl is not longer than the span.
func replaceSpan(b []byte, start, end int, repl []byte) []byte {
	delta := len(repl) - (end - start)
	if delta <= 0 {
		copy(b[start:], repl)
		copy(b[start+len(repl):], b[end:])
		return b[:len(b)+delta]
	}
	out := make([]byte, 0, len(b)+delta)
	out = append(out, b[:start]...)
	out = append(out, repl...)
	return append(out, b[end:]...)
}

// rewriteModel replaces the top-level "model" string of the object in b with
// the JSON literal lit. Bodies without a top-level model, or that are not
// objects, are returned unchanged.
func rewriteModel(b []byte, lit []byte) []byte {
	s, e, found, err := modelSpan(b)
	if err != nil || !found {
		return b
	}
	if string(b[s:e]) == string(lit) {
		return b
	}
	return replaceSpan(b, s, e, lit)
}

// quoteModel is appendJSONString for a fresh slice.
func quoteModel(s string) []byte { return appendJSONString(make([]byte, 0, len(s)+2), s) }
