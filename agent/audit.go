package agent

import (
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/placement"
)

// Event is one audited happening: a policy change, a refusal, a join or a
// leave. It is logged and fanned out to `infermesh events` followers.
type Event struct {
	Time   time.Time         `json:"time"`
	Kind   string            `json:"kind"`
	Role   string            `json:"role,omitempty"`
	Node   string            `json:"node,omitempty"`
	Fields map[string]string `json:"fields,omitempty"`
}

// Auditor logs audit events and fans them out to subscribers. Record never
// blocks: a subscriber that does not keep up loses events; the loss is
// counted per subscriber.
type Auditor struct {
	log *zap.Logger

	mu     sync.Mutex
	subs   map[chan Event]*int
	recent []Event // a short history for new followers
}

const auditHistory = 64

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
	a.recent = append(a.recent, e)
	if len(a.recent) > auditHistory {
		a.recent = append(a.recent[:0], a.recent[len(a.recent)-auditHistory:]...)
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
	if buffer < auditHistory {
		buffer = auditHistory
	}
	ch := make(chan Event, buffer)
	a.mu.Lock()
	for _, e := range lastN(a.recent, n) {
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

// Recent returns the recent history.
func (a *Auditor) Recent() []Event {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]Event(nil), a.recent...)
}
