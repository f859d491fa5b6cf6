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

// LogRing keeps the last N lines, and tells followers when one is added.
// Safe for concurrent use.
type LogRing struct {
	mu    sync.Mutex
	lines []LogLine
	next  int
	full  bool
	// total counts every line ever added: line i (from 0) is the i-th
	// added, whether it is still kept or not.
	total uint64
	// added is closed (and forgotten) at the next Add; made on demand by
	// Since, so a ring nobody follows allocates nothing per line.
	added chan struct{}
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
	r.total++
	if r.added != nil {
		close(r.added)
		r.added = nil
	}
}

// size is how many lines are kept; r.mu is held.
func (r *LogRing) size() int {
	if r.full {
		return len(r.lines)
	}
	return r.next
}

// lastLocked returns the n most recent lines, oldest first; r.mu is held
// and n is at most size().
func (r *LogRing) lastLocked(n int) []LogLine {
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

// Last returns up to n of the most recent lines, oldest first; n < 1 means
// all of them.
func (r *LogRing) Last(n int) []LogLine {
	r.mu.Lock()
	defer r.mu.Unlock()
	if size := r.size(); n < 1 || n > size {
		n = size
	}
	return r.lastLocked(n)
}

// Tail is Last(n) and the position after its last line, for Since.
func (r *LogRing) Tail(n int) ([]LogLine, uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if size := r.size(); n < 1 || n > size {
		n = size
	}
	return r.lastLocked(n), r.total
}

// Since returns the lines added at or after position pos (a value Tail or
// Since returned), oldest first, the position after them, and how many
// lines were added since pos but no longer kept (dropped). When there is
// nothing new, added is closed at the next Add.
func (r *LogRing) Since(pos uint64) (lines []LogLine, next, dropped uint64, added <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if pos >= r.total {
		if r.added == nil {
			r.added = make(chan struct{})
		}
		return nil, r.total, 0, r.added
	}
	n := r.total - pos
	if kept := uint64(r.size()); n > kept {
		dropped, n = n-kept, kept
	}
	return r.lastLocked(int(n)), r.total, dropped, nil
}
