package jsonskip

// Valid reports whether data is one valid JSON value (surrounded by
// optional whitespace). It accepts exactly what encoding/json.Valid accepts
// (a fuzz test holds it to that) at a fraction of the cost: json.Valid steps
// a state machine through a function pointer per byte and was half the demo
// model's chat handler's CPU time.
func Valid(data []byte) bool {
	i, ok := validValue(data, WS(data, 0), 0)
	return ok && WS(data, i) == len(data)
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
		i = WS(d, i+1)
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
			i = WS(d, i)
			if i >= len(d) || d[i] != ':' {
				return i, false
			}
			if i, ok = validValue(d, WS(d, i+1), depth+1); !ok {
				return i, false
			}
			i = WS(d, i)
			if i >= len(d) {
				return i, false
			}
			switch d[i] {
			case ',':
				i = WS(d, i+1)
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
		i = WS(d, i+1)
		if i < len(d) && d[i] == ']' {
			return i + 1, true
		}
		for {
			var ok bool
			if i, ok = validValue(d, i, depth+1); !ok {
				return i, false
			}
			i = WS(d, i)
			if i >= len(d) {
				return i, false
			}
			switch d[i] {
			case ',':
				i = WS(d, i+1)
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

// MemberErr says why a valid document has no usable member (ValidMember).
type MemberErr uint8

const (
	MemberOK        MemberErr = iota
	MemberNotObject           // the document is not an object
	MemberDuplicate           // the key appears twice at the top level
	MemberNotString           // the key's value is not a string
)

// Member is what ValidMember found: the span of the value of a top-level
// key, quotes included, when Found; Err when the document is valid but is
// not an object, repeats the key or gives it a non-string value (the
// first of these met, in document order).
type Member struct {
	Start, End int
	Found      bool
	Err        MemberErr
}

// ValidMember validates data as Valid does and, in the same pass, finds the
// string value of the top-level member named key (compared with the raw,
// unescaped bytes between the key's quotes). ok is false when data is not
// valid JSON; m is meaningful only when ok.
func ValidMember(data []byte, key string) (m Member, ok bool) {
	d := data
	i := WS(d, 0)
	if i >= len(d) || d[i] != '{' {
		i, ok = validValue(d, i, 0)
		return Member{Err: MemberNotObject}, ok && WS(d, i) == len(d)
	}
	i = WS(d, i+1)
	if i < len(d) && d[i] == '}' {
		return m, WS(d, i+1) == len(d)
	}
	for {
		if i >= len(d) || d[i] != '"' {
			return m, false
		}
		ks := i
		if i, ok = validString(d, i); !ok {
			return m, false
		}
		match := string(d[ks+1:i-1]) == key
		i = WS(d, i)
		if i >= len(d) || d[i] != ':' {
			return m, false
		}
		i = WS(d, i+1)
		vs := i
		if i, ok = validValue(d, i, 1); !ok {
			return m, false
		}
		if match && m.Err == MemberOK {
			switch {
			case m.Found:
				m = Member{Err: MemberDuplicate}
			case d[vs] != '"':
				m.Err = MemberNotString
			default:
				m.Start, m.End, m.Found = vs, i, true
			}
		}
		i = WS(d, i)
		if i >= len(d) {
			return m, false
		}
		switch d[i] {
		case ',':
			i = WS(d, i+1)
		case '}':
			return m, WS(d, i+1) == len(d)
		default:
			return m, false
		}
	}
}
