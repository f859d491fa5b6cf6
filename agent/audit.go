package agent

import (
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/placement"
)

// Event is one audited happening: a policy change, a refusal, a join or a
// leave. It is logged and fanned out to `infermesh events` followers, in
// the admin API's own form.
type Event = admin.Event

// Auditor logs audit events and fans them out to subscribers. Record never
// blocks: a subscriber that does not keep up loses events; the loss is
// counted per subscriber.
type Auditor struct {
	log *zap.Logger

	mu     sync.Mutex
	subs   map[chan Event]*int
	recent []Event // a short history for new followers: everything but refusals
	// refused is the history of refusals, apart: a flood of refusals (a
	// stranger's handshakes, a read-only admin user's writes) can push out
	// older refusals, never the joins, leaves and changes in recent.
	refused []Event
	version uint64 // events recorded: the state store saver's clock
}

// auditHistory bounds each of the two histories (refusals, the rest).
const auditHistory = 256

// isRefusal reports whether an event kind is a refusal
// (mesh.node.refused, mesh.quic.refused, admin.refused, ...).
func isRefusal(kind string) bool {
	return strings.HasSuffix(kind, ".refused") || strings.Contains(kind, ".refused.")
}

// NewAuditor returns an Auditor logging to log.
func NewAuditor(log *zap.Logger) *Auditor {
	return &Auditor{log: log.Named("audit"), subs: map[chan Event]*int{}}
}

var _ placement.AuditSink = (*Auditor)(nil)

// Audit records a placement audit event.
func (a *Auditor) Audit(e placement.AuditEvent) {
	a.Record(Event{Kind: e.Kind, Role: e.Role, Node: e.Node, Fields: e.Fields})
}

// Record logs e and delivers it to every subscriber without blocking.
func (a *Auditor) Record(e Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	fields := make([]zap.Field, 0, 3+len(e.Fields))
	fields = append(fields, zap.String("kind", e.Kind))
	if e.Role != "" {
		fields = append(fields, zap.String("role", e.Role))
	}
	if e.Node != "" {
		fields = append(fields, zap.String("node", e.Node))
	}
	for k, v := range e.Fields {
		fields = append(fields, zap.String(k, v))
	}
	a.log.Info("audit", fields...)

	a.mu.Lock()
	defer a.mu.Unlock()
	ring := &a.recent
	if isRefusal(e.Kind) {
		ring = &a.refused
	}
	*ring = append(*ring, e)
	a.version++
	if len(*ring) > auditHistory {
		*ring = append((*ring)[:0], (*ring)[len(*ring)-auditHistory:]...)
	}
	for ch, dropped := range a.subs {
		select {
		case ch <- e:
		default:
			*dropped++
		}
	}
}

// Subscribe returns a channel of events (starting with the recent history)
// and a cancel function that closes it.
func (a *Auditor) Subscribe(buffer int) (<-chan Event, func()) {
	return a.SubscribeLast(buffer, 0)
}

// SubscribeLast is Subscribe starting with only the last n events of the
// recent history (all of it when n < 1).
func (a *Auditor) SubscribeLast(buffer, n int) (<-chan Event, func()) {
	if buffer < 2*auditHistory {
		buffer = 2 * auditHistory
	}
	ch := make(chan Event, buffer)
	a.mu.Lock()
	for _, e := range lastN(a.historyLocked(), n) {
		ch <- e
	}
	var dropped int
	a.subs[ch] = &dropped
	a.mu.Unlock()
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			a.mu.Lock()
			delete(a.subs, ch)
			a.mu.Unlock()
			close(ch)
		})
	}
}

// Recent returns the recent history, refusals included, oldest first.
func (a *Auditor) Recent() []Event {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.historyLocked()
}

// historyLocked merges the two histories by time into a new slice.
func (a *Auditor) historyLocked() []Event {
	out := make([]Event, 0, len(a.recent)+len(a.refused))
	i, j := 0, 0
	for i < len(a.recent) || j < len(a.refused) {
		if j == len(a.refused) || (i < len(a.recent) && !a.refused[j].Time.Before(a.recent[i].Time)) {
			out = append(out, a.recent[i])
			i++
		} else {
			out = append(out, a.refused[j])
			j++
		}
	}
	return out
}
