package provision

import (
	"sync"
	"time"
)

// LogLine is one line of an instance's recent output.
type LogLine struct {
	Time   time.Time
	Stream string // "stdout", "stderr", "provider", "exited", "failed"
	Line   string
}

// LogRing keeps the last N lines. Safe for concurrent use.
type LogRing struct {
	mu    sync.Mutex
	lines []LogLine
	next  int
	full  bool
}

// NewLogRing returns a ring holding up to n lines (n < 1 means 1).
func NewLogRing(n int) *LogRing {
	return &LogRing{lines: make([]LogLine, max(n, 1))}
}

// Add appends a line, dropping the oldest when full.
func (r *LogRing) Add(l LogLine) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines[r.next] = l
	r.next = (r.next + 1) % len(r.lines)
	if r.next == 0 {
		r.full = true
	}
}

// Last returns up to n of the most recent lines, oldest first; n < 1 means
// all of them.
func (r *LogRing) Last(n int) []LogLine {
	r.mu.Lock()
	defer r.mu.Unlock()
	size := r.next
	if r.full {
		size = len(r.lines)
	}
	if n < 1 || n > size {
		n = size
	}
	out := make([]LogLine, 0, n)
	start := r.next - n
	if start < 0 {
		start += len(r.lines)
	}
	for i := 0; i < n; i++ {
		out = append(out, r.lines[(start+i)%len(r.lines)])
	}
	return out
}
