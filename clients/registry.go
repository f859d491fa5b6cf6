package clients

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Policy is how a Registry treats requests that name no client.
type Policy struct {
	// RequireKey refuses a request without a known key (or Unix
	// credentials a client names) with 401; false admits it as Anonymous.
	RequireKey bool
	// Anonymous is the anonymous client's roles, priority and limits
	// (its name and key are ignored).
	Anonymous Client
}

// Registry is the clients of this host, and each one's use of its
// limits. Admit is called on every app request, concurrently, and takes
// no lock but a client's own (for its rpm and tpm buckets, only when it
// has those limits); Set replaces the clients at once. The zero value is
// not usable: NewRegistry.
type Registry struct {
	snap atomic.Pointer[snapshot]
	mu   sync.Mutex        // serializes Set
	live map[string]*state // by name, across Sets: a rotated key keeps its client's use
	now  func() time.Time

	// Requests refused before any client was known.
	missingKey, unknownKey atomic.Int64
}

type snapshot struct {
	byKey      map[uint64][]*entry // by the first 8 bytes of the key's hash
	byUID      map[uint32]*entry
	byUnit     map[string]*entry
	anon       *entry
	requireKey bool
	all        []*entry // by name, anonymous first
}

type entry struct {
	Client
	st  *state
	now func() time.Time
}

// state is a client's use of its limits, kept across Sets.
type state struct {
	inFlight atomic.Int64

	mu       sync.Mutex
	reqLevel float64 // requests in the rpm bucket
	reqAt    time.Time
	tokLevel float64 // tokens in the tpm bucket (may be below 0)
	tokAt    time.Time
	fresh    bool // the buckets have not been filled yet

	requests, promptTokens, completionTokens atomic.Int64
	refused                                  [refusalKinds]atomic.Int64
}

// NewRegistry returns a registry with no clients, under p.
func NewRegistry(p Policy) *Registry {
	r := &Registry{live: map[string]*state{}, now: time.Now}
	if err := r.Set(nil, p); err != nil {
		panic(err) // no clients: nothing to conflict
	}
	return r
}

// Set replaces the clients and the policy. A client keeps its use of its
// limits (its requests in flight, its buckets) across a Set under the
// same name; a client left out is forgotten, its key refused from the
// moment Set returns. It fails, changing nothing, when two clients share
// a name, a key, a uid or a unit.
func (r *Registry) Set(cs []Client, p Policy) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := &snapshot{byKey: map[uint64][]*entry{}, byUID: map[uint32]*entry{}, byUnit: map[string]*entry{}, requireKey: p.RequireKey}
	live := make(map[string]*state, len(cs)+1)
	add := func(c Client) *entry {
		st := r.live[c.Name]
		if st == nil {
			st = &state{fresh: true}
		}
		live[c.Name] = st
		c.Roles = append([]string(nil), c.Roles...)
		e := &entry{Client: c, st: st, now: r.now}
		s.all = append(s.all, e)
		return e
	}
	anon := p.Anonymous
	anon.Name, anon.KeyHash, anon.HasUID, anon.Unit = Anonymous, [sha256.Size]byte{}, false, ""
	s.anon = add(anon)
	seenHash := map[[sha256.Size]byte]string{}
	for _, c := range cs {
		if _, dup := live[c.Name]; dup {
			return fmt.Errorf("client %q: named twice", c.Name)
		}
		e := add(c)
		if c.HasKey() {
			if other, dup := seenHash[c.KeyHash]; dup {
				return fmt.Errorf("client %q: has the key of client %q", c.Name, other)
			}
			seenHash[c.KeyHash] = c.Name
			k := binary.BigEndian.Uint64(c.KeyHash[:8])
			s.byKey[k] = append(s.byKey[k], e)
		}
		if c.HasUID {
			if other := s.byUID[c.UID]; other != nil {
				return fmt.Errorf("client %q: uid %d is client %q's", c.Name, c.UID, other.Name)
			}
			s.byUID[c.UID] = e
		}
		if c.Unit != "" {
			if other := s.byUnit[c.Unit]; other != nil {
				return fmt.Errorf("client %q: unit %q is client %q's", c.Name, c.Unit, other.Name)
			}
			s.byUnit[c.Unit] = e
		}
	}
	sort.Slice(s.all[1:], func(i, j int) bool { return s.all[1+i].Name < s.all[1+j].Name })
	r.live = live
	r.snap.Store(s)
	return nil
}

// RequireKey reports whether a request needs a known key.
func (r *Registry) RequireKey() bool { return r.snap.Load().requireKey }

// Caller is who sent a request, as far as the listener knows: the key it
// presented ("" none) and, on the Unix socket, its credentials.
type Caller struct {
	Key string
	// HasCreds: the connection came over the Unix socket, and UID and
	// Unit (the systemd unit of the calling process, "" when none) are
	// the kernel's word.
	HasCreds bool
	UID      uint32
	Unit     string
}

// Admit finds c's client and takes one request of role under its limits.
// The ticket must be ended with Done once the request ends. A refusal is
// what to answer instead; the ticket is then the zero Ticket (or the
// client's, refused by a limit: Name tells whose).
//
// A key of infermesh's form ("im-…") that no client holds is refused
// whatever the policy (it was revoked or rotated: its app must learn
// so). Any other key that matches no client, and no key, are Anonymous
// unless the policy requires a key: SDKs insist on sending some key, so
// apps of today send placeholders.
func (r *Registry) Admit(c Caller, role string) (Ticket, *Refusal) {
	s := r.snap.Load()
	e, ref := r.identify(s, c)
	if ref != nil {
		return Ticket{}, ref
	}
	if !e.Allows(role) {
		e.st.refused[refusedRole].Add(1)
		return Ticket{e: e}, &Refusal{Status: http.StatusForbidden, Type: "permission_error", Code: "role_not_allowed", Kind: refusedRole.String(),
			Message: "client " + strconv.Quote(e.Name) + " may not use role " + strconv.Quote(role)}
	}
	return r.take(e)
}

// Identify finds c's client without taking a request (for what no limit
// counts: the list of models): its name, or the refusal Admit would give.
func (r *Registry) Identify(c Caller) (string, *Refusal) {
	e, ref := r.identify(r.snap.Load(), c)
	if ref != nil {
		return "", ref
	}
	return e.Name, nil
}

func (r *Registry) identify(s *snapshot, c Caller) (*entry, *Refusal) {
	if c.Key != "" {
		h := sha256.Sum256([]byte(c.Key))
		for _, e := range s.byKey[binary.BigEndian.Uint64(h[:8])] {
			if subtle.ConstantTimeCompare(h[:], e.KeyHash[:]) == 1 {
				return e, nil
			}
		}
		if LooksLikeKey(c.Key) || s.requireKey {
			r.unknownKey.Add(1)
			return nil, errInvalidKey("the API key is not known here (revoked, rotated, or never issued by this host); ask the host's operator for one: infermesh clients add NAME")
		}
	}
	if c.HasCreds {
		if e := s.byUID[c.UID]; e != nil {
			return e, nil
		}
		if e := s.byUnit[c.Unit]; c.Unit != "" && e != nil {
			return e, nil
		}
	}
	if s.requireKey {
		r.missingKey.Add(1)
		return nil, errInvalidKey("this host requires an API key: send Authorization: Bearer <key> (or api-key: <key>); the host's operator makes one with infermesh clients add NAME")
	}
	return s.anon, nil
}

func errInvalidKey(msg string) *Refusal {
	return &Refusal{Status: http.StatusUnauthorized, Type: "invalid_request_error", Code: "invalid_api_key", Kind: "key", Message: msg}
}

// take admits one request of e under its limits.
func (r *Registry) take(e *entry) (Ticket, *Refusal) {
	st := e.st
	if m := e.MaxConcurrent; m > 0 {
		if st.inFlight.Add(1) > m {
			st.inFlight.Add(-1)
			st.refused[refusedConcurrency].Add(1)
			return Ticket{e: e}, &Refusal{Status: http.StatusTooManyRequests, Type: "requests", Code: "rate_limit_exceeded", Kind: refusedConcurrency.String(), RetryAfter: time.Second,
				Message: "client " + strconv.Quote(e.Name) + " has " + strconv.FormatInt(m, 10) + " requests in flight, its limit (max_concurrent); retry when one ends"}
		}
	} else {
		st.inFlight.Add(1)
	}
	if e.RPM > 0 || e.TPM > 0 {
		if ref := r.takeRate(e); ref != nil {
			st.inFlight.Add(-1)
			return Ticket{e: e}, ref
		}
	}
	st.requests.Add(1)
	return Ticket{e: e}, nil
}

// perSecond is a per-minute limit's refill rate.
func perSecond(perMinute int64) float64 { return float64(perMinute) / 60 }

// refill brings st's buckets up to now; st.mu held.
func (st *state) refill(l Limits, now time.Time) {
	if st.fresh {
		st.reqLevel, st.tokLevel, st.reqAt, st.tokAt, st.fresh = float64(l.RPM), float64(l.TPM), now, now, false
		return
	}
	if l.RPM > 0 {
		st.reqLevel = math.Min(float64(l.RPM), st.reqLevel+now.Sub(st.reqAt).Seconds()*perSecond(l.RPM))
	}
	st.reqAt = now
	if l.TPM > 0 {
		st.tokLevel = math.Min(float64(l.TPM), st.tokLevel+now.Sub(st.tokAt).Seconds()*perSecond(l.TPM))
	}
	st.tokAt = now
}

func (r *Registry) takeRate(e *entry) *Refusal {
	st := e.st
	now := r.now()
	st.mu.Lock()
	st.refill(e.Limits, now)
	var ref *Refusal
	switch {
	case e.RPM > 0 && st.reqLevel < 1:
		wait := time.Duration((1 - st.reqLevel) / perSecond(e.RPM) * float64(time.Second))
		ref = &Refusal{Status: http.StatusTooManyRequests, Type: "requests", Code: "rate_limit_exceeded", Kind: refusedRPM.String(), RetryAfter: wait,
			Message: "client " + strconv.Quote(e.Name) + " is over its limit of " + strconv.FormatInt(e.RPM, 10) + " requests per minute; retry in " + roundWait(wait).String()}
		st.refused[refusedRPM].Add(1)
	case e.TPM > 0 && st.tokLevel <= 0:
		wait := time.Duration((-st.tokLevel + 1) / perSecond(e.TPM) * float64(time.Second))
		ref = &Refusal{Status: http.StatusTooManyRequests, Type: "tokens", Code: "rate_limit_exceeded", Kind: refusedTPM.String(), RetryAfter: wait,
			Message: "client " + strconv.Quote(e.Name) + " is over its limit of " + strconv.FormatInt(e.TPM, 10) + " tokens per minute; retry in " + roundWait(wait).String()}
		st.refused[refusedTPM].Add(1)
	default:
		if e.RPM > 0 {
			st.reqLevel--
		}
	}
	if ref != nil {
		ref.Headers = appendRateHeaders(ref.Headers, e.Limits, st)
	}
	st.mu.Unlock()
	return ref
}

func roundWait(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(100 * time.Millisecond)
}

// Header is one response header, its name in canonical form.
type Header struct{ Name, Value string }

// appendRateHeaders appends OpenAI's x-ratelimit headers of the limits l
// sets, as st stands; st.mu held.
func appendRateHeaders(h []Header, l Limits, st *state) []Header {
	if l.RPM > 0 {
		rem := max(int64(st.reqLevel), 0)
		reset := time.Duration((float64(l.RPM) - st.reqLevel) / perSecond(l.RPM) * float64(time.Second))
		h = append(h,
			Header{"X-Ratelimit-Limit-Requests", strconv.FormatInt(l.RPM, 10)},
			Header{"X-Ratelimit-Remaining-Requests", strconv.FormatInt(rem, 10)},
			Header{"X-Ratelimit-Reset-Requests", roundWait(max(reset, 0)).String()})
	}
	if l.TPM > 0 {
		rem := max(int64(st.tokLevel), 0)
		reset := time.Duration((float64(l.TPM) - st.tokLevel) / perSecond(l.TPM) * float64(time.Second))
		h = append(h,
			Header{"X-Ratelimit-Limit-Tokens", strconv.FormatInt(l.TPM, 10)},
			Header{"X-Ratelimit-Remaining-Tokens", strconv.FormatInt(rem, 10)},
			Header{"X-Ratelimit-Reset-Tokens", roundWait(max(reset, 0)).String()})
	}
	return h
}

// Refusal is a request refused before any candidate saw it: the status,
// the OpenAI error's type, code and message, and the headers to send.
type Refusal struct {
	Status           int
	Type, Code, Kind string // Kind: which check (key, role, rpm, tpm, concurrency)
	Message          string
	RetryAfter       time.Duration // > 0: sent as Retry-After (whole seconds, rounded up) and retry-after-ms
	Headers          []Header
}

// RetryAfterSeconds is RetryAfter in whole seconds, rounded up (at least
// 1 when RetryAfter is positive).
func (f *Refusal) RetryAfterSeconds() int {
	if f.RetryAfter <= 0 {
		return 0
	}
	return int((f.RetryAfter + time.Second - 1) / time.Second)
}

type refusalKind uint8

const (
	refusedRole refusalKind = iota
	refusedRPM
	refusedTPM
	refusedConcurrency
	refusalKinds
)

func (k refusalKind) String() string {
	return [...]string{"role", "rpm", "tpm", "concurrency"}[k]
}

// Ticket is an admitted request's hold on its client's limits. The zero
// Ticket (no registry, or a request refused before a client was known) is
// valid and does nothing.
type Ticket struct{ e *entry }

// ByKey reports whether the client was known by the key the request
// presented: that key is then this host's alone and goes no further.
func (t Ticket) ByKey() bool { return t.e != nil && t.e.HasKey() }

// Name is the client's name ("" for the zero Ticket).
func (t Ticket) Name() string {
	if t.e == nil {
		return ""
	}
	return t.e.Name
}

// Priority is the client's priority.
func (t Ticket) Priority() Priority {
	if t.e == nil {
		return Normal
	}
	return t.e.Priority.clamp()
}

func (p Priority) clamp() Priority { return min(max(p, Low), High) }

// Done ends the request: it leaves the client's requests in flight, and
// what it cost (the tokens of its usage) is charged to its tpm bucket.
// Call it once per admitted ticket.
func (t Ticket) Done(promptTokens, completionTokens int64) {
	if t.e == nil {
		return
	}
	st := t.e.st
	st.inFlight.Add(-1)
	st.promptTokens.Add(promptTokens)
	st.completionTokens.Add(completionTokens)
	if t.e.TPM > 0 {
		if n := promptTokens + completionTokens; n > 0 {
			st.mu.Lock()
			st.refill(t.e.Limits, t.e.now())
			st.tokLevel -= float64(n)
			st.mu.Unlock()
		}
	}
}

// RateHeaders appends the x-ratelimit headers of t's client as its
// buckets stand now (none when it has no rpm or tpm limit).
func (t Ticket) RateHeaders(h []Header) []Header {
	if t.e == nil || (t.e.RPM == 0 && t.e.TPM == 0) {
		return h
	}
	st := t.e.st
	st.mu.Lock()
	defer st.mu.Unlock()
	return appendRateHeaders(h, t.e.Limits, st)
}

// Stat is a client's use, for `infermesh clients list` and the metrics.
type Stat struct {
	Name                           string
	InFlight                       int64
	Requests                       int64
	PromptTokens, CompletionTokens int64
	// Refused by the check that refused them: role, rpm, tpm, concurrency.
	Refused map[string]int64
}

// Stats is every client's use, Anonymous first, then by name; and the
// requests refused before a client was known (no key, an unknown key).
func (r *Registry) Stats() (stats []Stat, missingKey, unknownKey int64) {
	s := r.snap.Load()
	stats = make([]Stat, 0, len(s.all))
	for _, e := range s.all {
		st := Stat{Name: e.Name, InFlight: e.st.inFlight.Load(), Requests: e.st.requests.Load(),
			PromptTokens: e.st.promptTokens.Load(), CompletionTokens: e.st.completionTokens.Load(), Refused: map[string]int64{}}
		for k := refusalKind(0); k < refusalKinds; k++ {
			st.Refused[k.String()] = e.st.refused[k].Load()
		}
		stats = append(stats, st)
	}
	return stats, r.missingKey.Load(), r.unknownKey.Load()
}
