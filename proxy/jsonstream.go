package proxy

import (
	"bytes"
	"io"
)

// pinnedHoldMax is how much of a pinned instance's JSON answer the proxy
// holds to rewrite its model in place (rewriteModel) and send it with its
// exact Content-Length. A larger answer is rewritten as it streams
// (modelStream), so an answer of any size costs a request no more memory
// than this.
const pinnedHoldMax = 64 << 10

// modelStream is rewriteModel for an answer too large to hold: it passes a
// JSON document on to w as it is written, with the string value of the
// top-level "model" key replaced by lit, keeping between writes only the
// few bytes of state of where it is in the document. It finds the key as
// modelSpan does (the raw key bytes, escapes undecoded) and leaves the
// document untouched where modelSpan finds nothing to rewrite: not an
// object, no top-level model, or a model that is not a string. Where
// modelSpan refuses a document with two top-level model keys, which
// cannot be known before its end, every string one is replaced: the
// instance's own model name never reaches the client. Once the top-level
// object ends, or the document turns out not to be one, the rest passes
// untouched.
//
// Not safe for concurrent use.
type modelStream struct {
	w     io.Writer
	lit   []byte
	n     int64 // bytes written to w
	st    msState
	esc   bool // in a string: the next byte is escaped
	inStr bool // msNested: inside a string
	depth int  // msNested: open objects and arrays
	key   [5]byte
	keyN  int // bytes of the current top-level key (its first 5 in key)
}

// Where a modelStream is in the document.
type msState uint8

const (
	msStart    msState = iota // before the document
	msKeyOrEnd                // in the top-level object, before a key or its end
	msKey                     // in a top-level key
	msColon                   // after a key
	msValue                   // after the colon
	msString                  // in a top-level string value
	msModel                   // in the model value being replaced: skipped
	msNested                  // in a top-level object or array value
	msScalar                  // in a top-level number or literal
	msAfter                   // after a top-level value
	msPass                    // the rest passes untouched
)

// nestedStop marks the bytes a nested value's scan stops at.
var nestedStop = [256]bool{'"': true, '{': true, '[': true, '}': true, ']': true}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (m *modelStream) isModel() bool { return m.keyN == len(m.key) && string(m.key[:]) == "model" }

func (m *modelStream) write(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	k, err := m.w.Write(b)
	m.n += int64(k)
	return err
}

// Write passes p on, rewritten; it returns len(p) unless w failed.
func (m *modelStream) Write(p []byte) (int, error) {
	from := 0 // p[from:i] is still to be passed on
	i := 0
	for i < len(p) {
		c := p[i]
		switch m.st {
		case msPass:
			i = len(p)
			continue
		case msString, msModel:
			end, closed := m.scanString(p, i)
			if m.st == msModel {
				from = end // the instance's literal is dropped
			}
			i = end
			if closed {
				m.st = msAfter
			}
			continue
		case msNested:
			i = m.scanNested(p, i)
			continue
		case msKey:
			i++
			switch {
			case m.esc:
				m.esc = false
			case c == '\\':
				m.esc = true
			case c == '"':
				m.st = msColon
				continue
			}
			if m.keyN < len(m.key) {
				m.key[m.keyN] = c
			}
			m.keyN++
			continue
		case msScalar:
			if c == ',' || c == '}' || c == ']' || isJSONSpace(c) {
				m.st = msAfter // c is looked at there
				continue
			}
			i++
			continue
		}
		if isJSONSpace(c) {
			i++
			continue
		}
		switch m.st {
		case msStart:
			if c == '{' {
				m.st = msKeyOrEnd
			} else {
				m.st = msPass
			}
		case msKeyOrEnd:
			switch c {
			case '"':
				m.st, m.keyN, m.esc = msKey, 0, false
			case ',': // tolerated, as modelSpan does
			default: // '}' ends the object; anything else is not JSON
				m.st = msPass
			}
		case msColon:
			if c == ':' {
				m.st = msValue
			} else {
				m.st = msPass
			}
		case msValue:
			switch {
			case c == '"' && m.isModel():
				if err := m.write(p[from:i]); err != nil {
					return i, err
				}
				if err := m.write(m.lit); err != nil {
					return i, err
				}
				from = i + 1
				m.st, m.esc = msModel, false
			case c == '"':
				m.st, m.esc = msString, false
			case c == '{' || c == '[':
				m.st, m.depth, m.inStr = msNested, 1, false
			default:
				m.st = msScalar
			}
		case msAfter:
			if c == ',' {
				m.st = msKeyOrEnd
			} else {
				m.st = msPass // '}' ends the object
			}
		}
		i++
	}
	if err := m.write(p[from:]); err != nil {
		return len(p), err
	}
	return len(p), nil
}

// scanString steps over string bytes from p[i] (the byte just past the
// opening quote, or where the last write left off): it returns the index
// just past the closing quote and true, or len(p) and false when the
// string goes on in the next write (m.esc then says whether that write's
// first byte is escaped). Like jsonskip.String, it jumps from quote to
// quote and counts the backslashes before each.
func (m *modelStream) scanString(p []byte, i int) (int, bool) {
	if m.esc {
		m.esc = false
		i++
	}
	for i < len(p) {
		j := bytes.IndexByte(p[i:], '"')
		if j < 0 {
			n := 0
			for k := len(p) - 1; k >= i && p[k] == '\\'; k-- {
				n++
			}
			m.esc = n%2 == 1
			return len(p), false
		}
		q := i + j
		n := 0
		for k := q - 1; k >= i && p[k] == '\\'; k-- {
			n++
		}
		if n%2 == 0 {
			return q + 1, true
		}
		i = q + 1
	}
	return len(p), false
}

// scanNested steps over a top-level object or array value from p[i] and
// returns where it stopped: past the value's end (m.st is then msAfter),
// or len(p).
func (m *modelStream) scanNested(p []byte, i int) int {
	for i < len(p) {
		if m.inStr {
			end, closed := m.scanString(p, i)
			i = end
			if !closed {
				return i
			}
			m.inStr = false
			continue
		}
		switch p[i] {
		case '"':
			m.inStr, m.esc = true, false
		case '{', '[':
			m.depth++
		case '}', ']':
			m.depth--
			if m.depth == 0 {
				m.st = msAfter
				return i + 1
			}
		}
		i++
		for i < len(p) && !nestedStop[p[i]] {
			i++
		}
	}
	return i
}

// readPinned reads an answer into b until it ends (whole reports it is all
// in b) or b holds more than limit bytes; hint is its declared length (-1:
// unknown).
func readPinned(b []byte, r io.Reader, hint, limit int64) (_ []byte, whole bool, _ error) {
	if hint < 0 || hint > limit {
		hint = 4096
	}
	if int64(cap(b)) < hint+1 {
		b = make([]byte, 0, hint+1)
	}
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, true, nil
		}
		if err != nil {
			return b, false, err
		}
		if int64(len(b)) > limit {
			return b, false, nil
		}
	}
}
