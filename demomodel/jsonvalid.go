package demomodel

import "github.com/infermesh/infermesh/internal/jsonskip"

// jsonValid reports whether data is one valid JSON value (surrounded by
// optional whitespace). It accepts exactly what encoding/json.Valid accepts
// (a fuzz test holds it to that) at a fraction of the cost: json.Valid steps
// a state machine through a function pointer per byte and was half the chat
// handler's CPU time.
func jsonValid(data []byte) bool {
	i, ok := validValue(data, jsonskip.WS(data, 0), 0)
	return ok && jsonskip.WS(data, i) == len(data)
}

// maxNesting matches encoding/json's nesting limit.
const maxNesting = 10000

func validValue(d []byte, i, depth int) (int, bool) {
	if i >= len(d) {
		return i, false
	}
	switch d[i] {
	case '"':
		return validString(d, i)
	case '{':
		if depth >= maxNesting {
			return i, false
		}
		i = jsonskip.WS(d, i+1)
		if i < len(d) && d[i] == '}' {
			return i + 1, true
		}
		for {
			if i >= len(d) || d[i] != '"' {
				return i, false
			}
			var ok bool
			if i, ok = validString(d, i); !ok {
				return i, false
			}
			i = jsonskip.WS(d, i)
			if i >= len(d) || d[i] != ':' {
				return i, false
			}
			if i, ok = validValue(d, jsonskip.WS(d, i+1), depth+1); !ok {
				return i, false
			}
			i = jsonskip.WS(d, i)
			if i >= len(d) {
				return i, false
			}
			switch d[i] {
			case ',':
				i = jsonskip.WS(d, i+1)
			case '}':
				return i + 1, true
			default:
				return i, false
			}
		}
	case '[':
		if depth >= maxNesting {
			return i, false
		}
		i = jsonskip.WS(d, i+1)
		if i < len(d) && d[i] == ']' {
			return i + 1, true
		}
		for {
			var ok bool
			if i, ok = validValue(d, i, depth+1); !ok {
				return i, false
			}
			i = jsonskip.WS(d, i)
			if i >= len(d) {
				return i, false
			}
			switch d[i] {
			case ',':
				i = jsonskip.WS(d, i+1)
			case ']':
				return i + 1, true
			default:
				return i, false
			}
		}
	case 't':
		return validLiteral(d, i, "true")
	case 'f':
		return validLiteral(d, i, "false")
	case 'n':
		return validLiteral(d, i, "null")
	default:
		return validNumber(d, i)
	}
}

func validLiteral(d []byte, i int, lit string) (int, bool) {
	if len(d)-i >= len(lit) && string(d[i:i+len(lit)]) == lit {
		return i + len(lit), true
	}
	return i, false
}

// validString checks the string starting at d[i] == '"'. Like encoding/json
// it rejects control characters and bad escapes but not invalid UTF-8
// (which decoding replaces with U+FFFD).
func validString(d []byte, i int) (int, bool) {
	i++
	for i < len(d) {
		c := d[i]
		switch {
		case c == '"':
			return i + 1, true
		case c < 0x20:
			return i, false
		case c == '\\':
			i++
			if i >= len(d) {
				return i, false
			}
			switch d[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i++
			case 'u':
				if len(d)-i < 5 {
					return i, false
				}
				for _, h := range d[i+1 : i+5] {
					if !isHex(h) {
						return i, false
					}
				}
				i += 5
			default:
				return i, false
			}
		default:
			i++
		}
	}
	return i, false
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// validNumber checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func validNumber(d []byte, i int) (int, bool) {
	if i < len(d) && d[i] == '-' {
		i++
	}
	switch {
	case i < len(d) && d[i] == '0':
		i++
	case i < len(d) && d[i] >= '1' && d[i] <= '9':
		for i++; i < len(d) && isDigit(d[i]); i++ {
		}
	default:
		return i, false
	}
	if i < len(d) && d[i] == '.' {
		i++
		if i >= len(d) || !isDigit(d[i]) {
			return i, false
		}
		for ; i < len(d) && isDigit(d[i]); i++ {
		}
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		i++
		if i < len(d) && (d[i] == '+' || d[i] == '-') {
			i++
		}
		if i >= len(d) || !isDigit(d[i]) {
			return i, false
		}
		for ; i < len(d) && isDigit(d[i]); i++ {
		}
	}
	return i, true
}
