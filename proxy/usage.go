package proxy

import (
	"bytes"
	"io"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// meterTail is how much of a response's end a meter keeps: enough for the
// final SSE event with its usage, or the end of a JSON body, where
// OpenAI-compatible servers put "usage".
const meterTail = 4 << 10

// meter passes a response body through to the client and notes what the
// metrics need without decoding it: when the first SSE event went out,
// and the body's last meterTail bytes. An open stream holds its meter, so
// the tail is a ring of exactly meterTail bytes, made contiguous once at
// the end (Tail).
type meter struct {
	w     io.Writer
	sse   bool
	start time.Time
	first time.Duration
	ring  []byte // len meterTail
	pos   int    // where the next byte goes
	full  bool   // the ring wrapped: all of it is tail, oldest at pos
}

var meterPool = sync.Pool{New: func() any { return &meter{ring: make([]byte, meterTail)} }}

func getMeter(w io.Writer, sse bool, start time.Time) *meter {
	m := meterPool.Get().(*meter)
	m.w, m.sse, m.start, m.first, m.pos, m.full = w, sse, start, 0, 0, false
	return m
}

func (m *meter) release() {
	m.w = nil
	meterPool.Put(m)
}

var sseData = []byte("data:")

func (m *meter) Write(b []byte) (int, error) {
	if m.sse && m.first == 0 && bytes.Contains(b, sseData) {
		m.first = max(time.Since(m.start), 1)
	}
	m.note(b)
	return m.w.Write(b)
}

// note keeps b's bytes in the ring.
func (m *meter) note(b []byte) {
	if len(b) >= meterTail {
		copy(m.ring, b[len(b)-meterTail:])
		m.pos, m.full = 0, true
		return
	}
	n := copy(m.ring[m.pos:], b)
	if n < len(b) {
		copy(m.ring, b[n:])
		m.full = true
	}
	m.pos = (m.pos + len(b)) % meterTail
	if m.pos == 0 && len(b) > 0 {
		m.full = true
	}
}

// Tail is the last meterTail bytes written (all of them when fewer), in
// order, valid until the next Write. It rotates the ring in place.
func (m *meter) Tail() []byte {
	if !m.full {
		return m.ring[:m.pos]
	}
	// Rotate left by pos: the oldest byte first.
	slices.Reverse(m.ring[:m.pos])
	slices.Reverse(m.ring[m.pos:])
	slices.Reverse(m.ring)
	m.pos = 0 // still full, oldest first
	return m.ring
}

var usageKey = []byte(`"usage"`)

// lastUsage finds the last "usage" object in b (a JSON body, or the end of
// an SSE stream, whose last usage is the final count) and reads its
// prompt_tokens and completion_tokens. ok is false when b holds none (no
// usage, "usage": null, or an object cut by the start of b).
func lastUsage(b []byte) (prompt, completion int64, ok bool) {
	for end := len(b); ; {
		k := lastKey(b[:end], usageKey)
		if k < 0 {
			return 0, 0, false
		}
		end = k
		if k > 0 && b[k-1] == '\\' {
			continue // inside a string
		}
		i := jsonskip.WS(b, k+len(usageKey))
		if i >= len(b) || b[i] != ':' {
			continue
		}
		i = jsonskip.WS(b, i+1)
		if i >= len(b) || b[i] != '{' {
			continue
		}
		if prompt, completion, ok = usageCounts(b, i); ok {
			return prompt, completion, true
		}
	}
}

// lastKey is bytes.LastIndex(b, key) for a key that starts with '"':
// usage sits near the end of what it is asked about, and LastIndex
// hashes every byte it passes (Rabin-Karp), where this compares only at
// quotes.
func lastKey(b, key []byte) int {
	for k := len(b) - len(key); k >= 0; k-- {
		if b[k] == '"' && bytes.Equal(b[k:k+len(key)], key) {
			return k
		}
	}
	return -1
}

// usageCounts reads the token counts of the usage object starting at b[i].
func usageCounts(b []byte, i int) (prompt, completion int64, ok bool) {
	i++
	for {
		i = jsonskip.WS(b, i)
		if i >= len(b) {
			return 0, 0, false
		}
		switch b[i] {
		case '}':
			return prompt, completion, ok
		case ',':
			i++
			continue
		case '"':
		default:
			return 0, 0, false
		}
		ks := i
		ke, good := jsonskip.String(b, i)
		if !good {
			return 0, 0, false
		}
		i = jsonskip.WS(b, ke)
		if i >= len(b) || b[i] != ':' {
			return 0, 0, false
		}
		vs := jsonskip.WS(b, i+1)
		ve, good := jsonskip.Value(b, vs)
		if !good {
			return 0, 0, false
		}
		i = ve
		var dst *int64
		switch string(b[ks+1 : ke-1]) {
		case "prompt_tokens":
			dst = &prompt
		case "completion_tokens":
			dst = &completion
		default:
			continue
		}
		n, err := strconv.ParseInt(string(b[vs:ve]), 10, 64)
		if err != nil || n < 0 {
			return 0, 0, false
		}
		*dst, ok = n, true
	}
}
