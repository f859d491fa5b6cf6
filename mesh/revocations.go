package mesh

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/placement"
)

// Signed revocations. A run-time revocation (Revoke) is this node's own
// decision: its peers do not hear of it, and a peer's word that a node is
// revoked is worth nothing (any full-scope node could then cut any other
// out). A statement signed by a cluster authority (identity.Revocation) is
// evidence any node can check, so every node takes it from anyone: the
// admin socket, gossip (a broadcast when a node first holds it, and every
// push/pull, joins included) and the QUIC transport (SpreadRevocation,
// serveRevocation). A node keeps the newest statement about each subject,
// whether it revokes or lifts a revocation, and persists it through its
// RevocationSink: a replayed older statement is older than what is held and
// changes nothing, here or after a restart.

// Errors callers act on.
var (
	// ErrStaleRevocation is wrapped by AcceptRevocation for a statement
	// older than the one held about its subject.
	ErrStaleRevocation = errors.New("a newer revocation statement about this subject is held")
	// ErrTooManyRevocations is returned when the statements held about
	// distinct subjects reach maxHeldRevocations.
	ErrTooManyRevocations = errors.New("too many revocation statements held")
)

// Audit kinds of signed revocations.
const (
	// AuditRevocationAccepted: this node holds a new signed statement, with
	// the authority that signed it and the channel it came by.
	AuditRevocationAccepted = "mesh.revocation.accepted"
	// AuditRevocationRefused: a statement did not verify against this
	// node's authorities (rate-limited, like every refusal).
	AuditRevocationRefused = "mesh.revocation.refused"
)

// Refusal reasons of statements: not signed by a trusted authority (or
// not parsable), and older than the one held about their subject (a
// replay, or a node that has not heard the newer one yet).
const (
	reasonRevocationSignature = "bad_revocation"
	reasonRevocationStale     = "stale_revocation"
)

// msgRevocation is a gossip user message carrying one statement:
//
//	revocation: 0x04 | statement (identity.Revocation.Marshal)
//
// and the section push/pull state ends with, after its adverts
// (appendSection):
//
//	0x04 | count (uvarint) | count x (length (uvarint) | statement)
const msgRevocation byte = 0x04

// maxHeldRevocations bounds the subjects statements are held about: only
// an authority can make more, and it would have to sign that many.
const maxHeldRevocations = 4096

// heldRevocation is the newest statement held about one subject.
type heldRevocation struct {
	r      *identity.Revocation
	signer ed25519.PublicKey // the authority whose signature verified
}

// RevocationNews is one statement this node accepted, for its
// RevocationSink.
type RevocationNews struct {
	Revocation *identity.Revocation
	// Authority is the key whose signature verified.
	Authority ed25519.PublicKey
	// Via is the channel it came by: "admin", "gossip", "push/pull",
	// "quic:<peer>".
	Via string
}

// RevocationSink persists the statements this node accepts (the agent's
// state store). It is called from one goroutine of the Mesh, in the order
// the statements were accepted, and may block on disk.
type RevocationSink interface {
	RevocationAccepted(RevocationNews)
}

// revocationOutbox holds accepted statements until the sink takes them:
// the sink is set once the state store is open, after the Mesh started.
type revocationOutbox struct {
	mu    sync.Mutex
	sink  RevocationSink
	queue []RevocationNews
	wake  chan struct{} // capacity 1
}

// SetRevocationSink makes s the sink of accepted statements; those
// accepted before are delivered to it first.
func (m *Mesh) SetRevocationSink(s RevocationSink) {
	m.revOut.mu.Lock()
	m.revOut.sink = s
	m.revOut.mu.Unlock()
	m.revOut.signal()
}

func (o *revocationOutbox) signal() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

func (o *revocationOutbox) push(n RevocationNews) {
	o.mu.Lock()
	o.queue = append(o.queue, n)
	o.mu.Unlock()
	o.signal()
}

// revocationLoop delivers accepted statements to the sink, in order.
func (m *Mesh) revocationLoop() {
	defer m.wg.Done()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-m.revOut.wake:
		}
		m.revOut.mu.Lock()
		s, q := m.revOut.sink, m.revOut.queue
		if s != nil {
			m.revOut.queue = nil
		}
		m.revOut.mu.Unlock()
		if s == nil {
			continue
		}
		for _, n := range q {
			s.RevocationAccepted(n)
		}
	}
}

func subjectOf(r *identity.Revocation) revocation {
	if r.PublicKey != nil {
		return revocation{key: string(r.PublicKey)}
	}
	return revocation{name: r.Name}
}

// inForce is the subjects the held statements revoke now.
func inForce(held map[revocation]*heldRevocation) map[revocation]*heldRevocation {
	out := make(map[revocation]*heldRevocation, len(held))
	for k, h := range held {
		if h.r.Revoked {
			out[k] = h
		}
	}
	return out
}

// AcceptRevocation makes r the statement held about its subject when it is
// signed by one of this node's authorities and newer than the one held
// (identity.Revocation.Newer): the subject is revoked, or no longer revoked
// by statement, at once, and r spreads by gossip. via names the channel it
// came by, for the audit. It reports whether r was new; a statement
// already held returns false, nil; an older one an error wrapping
// ErrStaleRevocation; one not signed by a trusted authority an error
// wrapping identity.ErrBadRevocation (counted and audited).
func (m *Mesh) AcceptRevocation(r *identity.Revocation, via string) (bool, error) {
	subj := subjectOf(r)
	m.mu.RLock()
	held, t := m.revs[subj], m.trust
	m.mu.RUnlock()
	// Nothing older than what is held is worth a signature check: replays
	// cost a comparison.
	if held != nil && !r.Newer(held.r) {
		return false, staleErr(r, held.r)
	}
	signer, err := identity.VerifyRevocation(r, t.authorities)
	if err != nil {
		m.refuse(AuditRevocationRefused, r.Subject(), "", reasonRevocationSignature, via+": "+err.Error())
		return false, err
	}
	m.mu.Lock()
	if held := m.revs[subj]; held != nil && !r.Newer(held.r) {
		m.mu.Unlock()
		return false, staleErr(r, held.r)
	}
	if !slices.EqualFunc(m.trust.authorities, t.authorities, func(a, b ed25519.PublicKey) bool { return a.Equal(b) }) {
		// The authorities changed since the check (SetTrust).
		if _, err := identity.VerifyRevocation(r, m.trust.authorities); err != nil {
			m.mu.Unlock()
			return false, err
		}
	}
	if m.revs[subj] == nil && len(m.revs) >= maxHeldRevocations {
		m.mu.Unlock()
		return false, fmt.Errorf("%w (%d)", ErrTooManyRevocations, maxHeldRevocations)
	}
	m.revs[subj] = &heldRevocation{r: r, signer: signer}
	m.trust = m.trust.withSigned(inForce(m.revs))
	m.mu.Unlock()

	m.bcast.QueueBroadcast(&advertBroadcast{name: "revocation/" + r.Subject(), msg: encodeRevocationMsg(r)})
	m.revOut.push(RevocationNews{Revocation: r, Authority: signer, Via: via})
	m.log.Info("signed revocation statement accepted", zap.String("subject", r.Subject()), zap.String("op", r.Op()),
		zap.Uint64("serial", r.Serial), zap.String("authority", identity.EncodeAuthorityKey(signer)), zap.String("via", via))
	if r.Revoked && (r.Name == m.name || r.PublicKey.Equal(m.pub)) {
		m.log.Error("the authority revoked THIS node: every node that holds the statement refuses it", zap.Uint64("serial", r.Serial))
	}
	if m.cfg.Audit != nil {
		m.cfg.Audit.Audit(placement.AuditEvent{Kind: AuditRevocationAccepted, Node: r.Subject(), Fields: map[string]string{
			"op": r.Op(), "serial": fmt.Sprint(r.Serial), "issued": r.IssuedAt.UTC().Format(time.RFC3339),
			"authority": identity.EncodeAuthorityKey(signer), "via": via,
		}})
	}
	m.enforceAdmission()
	if !r.Revoked {
		m.contactRefused()
	}
	return true, nil
}

func staleErr(r, held *identity.Revocation) error {
	if bytes.Equal(r.Signature, held.Signature) {
		return nil // the same statement
	}
	return fmt.Errorf("%w: %s %s has serial %d, the one held (%s) %d", ErrStaleRevocation, r.Op(), r.Subject(), r.Serial, held.Op(), held.Serial)
}

// LoadRevocations holds rs (the state store's, at start) as AcceptRevocation
// would, without spreading them or telling the sink: they came from it.
// Statements that do not verify or are older than those held are skipped,
// each named in the error.
func (m *Mesh) LoadRevocations(rs []*identity.Revocation) error {
	var errs []error
	changed := false
	m.mu.Lock()
	for _, r := range rs {
		subj := subjectOf(r)
		if held := m.revs[subj]; held != nil && !r.Newer(held.r) {
			continue
		}
		signer, err := identity.VerifyRevocation(r, m.trust.authorities)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %s (serial %d): %w", r.Op(), r.Subject(), r.Serial, err))
			continue
		}
		if m.revs[subj] == nil && len(m.revs) >= maxHeldRevocations {
			errs = append(errs, fmt.Errorf("%s %s: %w", r.Op(), r.Subject(), ErrTooManyRevocations))
			continue
		}
		m.revs[subj] = &heldRevocation{r: r, signer: signer}
		changed = true
	}
	if changed {
		m.trust = m.trust.withSigned(inForce(m.revs))
	}
	m.mu.Unlock()
	if changed {
		m.enforceAdmission()
	}
	return errors.Join(errs...)
}

// reverifyRevocationsLocked drops the held statements t's authorities did
// not sign (after an authority change) and returns t with the rest in
// force. m.mu must be held for writing.
func (m *Mesh) reverifyRevocationsLocked(t *trustState) *trustState {
	for k, h := range m.revs {
		signer, err := identity.VerifyRevocation(h.r, t.authorities)
		if err != nil {
			m.log.Warn("signed revocation statement dropped: no configured authority signed it", zap.String("subject", h.r.Subject()),
				zap.String("signed_by", identity.EncodeAuthorityKey(h.signer)))
			delete(m.revs, k)
			continue
		}
		// A new record: the old one may be read through a trust state
		// already handed out, without the lock.
		m.revs[k] = &heldRevocation{r: h.r, signer: signer}
	}
	return t.withSigned(inForce(m.revs))
}

// Revocation returns the statement held about subject (a node name or a
// base64 public key).
func (m *Mesh) Revocation(subject string) (*identity.Revocation, bool) {
	name, key, err := identity.ParseRevocationSubject(subject)
	if err != nil {
		return nil, false
	}
	subj := revocation{name: name, key: string(key)}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if h := m.revs[subj]; h != nil {
		return h.r, true
	}
	return nil, false
}

// Revocations lists the statements held, by subject.
func (m *Mesh) Revocations() []*identity.Revocation {
	m.mu.RLock()
	out := make([]*identity.Revocation, 0, len(m.revs))
	for _, h := range m.revs {
		out = append(out, h.r)
	}
	m.mu.RUnlock()
	slices.SortFunc(out, func(a, b *identity.Revocation) int { return strings.Compare(a.Subject(), b.Subject()) })
	return out
}

func encodeRevocationMsg(r *identity.Revocation) []byte {
	return append([]byte{msgRevocation}, r.Marshal()...)
}

// handleRevocationMsg takes a gossiped statement.
func (m *Mesh) handleRevocationMsg(b []byte, via string) {
	r, err := identity.UnmarshalRevocation(b[1:])
	if err != nil {
		m.refuse(AuditRevocationRefused, "", "", reasonRevocationSignature, via+": "+err.Error())
		return
	}
	m.takeRevocation(r, via)
}

// takeRevocation is AcceptRevocation for the gossip paths: a statement
// older than the one held is counted and audited (rate-limited).
func (m *Mesh) takeRevocation(r *identity.Revocation, via string) {
	_, err := m.AcceptRevocation(r, via)
	switch {
	case errors.Is(err, ErrStaleRevocation):
		m.refuse(AuditRevocationRefused, r.Subject(), "", reasonRevocationStale, via+": "+err.Error())
	case err != nil && !errors.Is(err, identity.ErrBadRevocation):
		m.log.Debug("revocation statement not taken", zap.String("via", via), zap.Error(err))
	}
}

// appendRevocations appends the held statements to push/pull state, as
// a section of their own (none when none are held: older agents read the
// adverts and ignore what follows them).
func (m *Mesh) appendRevocations(b []byte) []byte {
	m.mu.RLock()
	msgs := make([][]byte, 0, len(m.revs))
	for _, h := range m.revs {
		msgs = append(msgs, h.r.Marshal())
	}
	m.mu.RUnlock()
	if len(msgs) == 0 {
		return b
	}
	return appendSection(b, msgRevocation, msgs)
}

// mergeRevocations takes the statements section of push/pull state (what
// follows the adverts; empty when the peer holds none).
func (m *Mesh) mergeRevocations(b []byte) {
	if len(b) == 0 {
		return
	}
	_, bad := readSection(b, msgRevocation, func(msg []byte) {
		r, err := identity.UnmarshalRevocation(msg) // copies what it keeps
		if err != nil {
			m.refuse(AuditRevocationRefused, "", "", reasonRevocationSignature, "push/pull: "+err.Error())
			return
		}
		m.takeRevocation(r, "push/pull")
	})
	if bad != "" {
		m.refuse(auditAdvertRefused, "", "", reasonMalformed, "push/pull state: revocations: "+bad)
	}
}

// RevocationPusher sends a statement to a peer over an authenticated
// channel (the Transport). It must return when ctx ends.
type RevocationPusher interface {
	PushRevocation(ctx context.Context, node string, r *identity.Revocation) error
}

// RevocationTaker takes statements peers send; *Mesh satisfies it.
type RevocationTaker interface {
	AcceptRevocation(r *identity.Revocation, via string) (bool, error)
}

var (
	_ RevocationPusher = (*Transport)(nil)
	_ RevocationTaker  = (*Mesh)(nil)
)

// SpreadResult says which peers a statement reached over QUIC.
type SpreadResult struct {
	Peers  []string          // admitted live peers that took it (or held it already)
	Failed map[string]string // peers it did not reach, with why
}

// spreadParallel bounds the pushes of SpreadRevocation in flight.
const spreadParallel = 16

// SpreadRevocation sends r to every admitted live peer over p at once, as
// well as by gossip: a peer that takes it refuses the subject from then
// on. It returns when every push ended or ctx did.
func (m *Mesh) SpreadRevocation(ctx context.Context, p RevocationPusher, r *identity.Revocation) SpreadResult {
	peers := m.admittedPeers()
	res := SpreadResult{Failed: map[string]string{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, spreadParallel)
	for _, n := range peers {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			err := p.PushRevocation(ctx, n, r)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.Failed[n] = err.Error()
				return
			}
			res.Peers = append(res.Peers, n)
		}()
	}
	wg.Wait()
	slices.Sort(res.Peers)
	return res
}

// revocationPath is where peers send signed statements (any verified peer:
// the signature is the evidence).
const revocationPath = "/.well-known/infermesh/revocation"

// PushRevocation sends r to node over QUIC: it implements RevocationPusher.
// A node that is trusted but not a live member here (gossip lost it) is
// reached at the address it last gossiped.
func (t *Transport) PushRevocation(ctx context.Context, node string, r *identity.Revocation) error {
	status, msg, err := t.postTrusted(ctx, node, revocationPath, "text/plain", []byte(r.String()))
	if err != nil {
		return err
	}
	if status != http.StatusNoContent {
		return fmt.Errorf("%s answered %d: %s", node, status, msg)
	}
	return nil
}

// serveRevocation takes a statement from a verified peer.
func (t *Transport) serveRevocation(w http.ResponseWriter, r *http.Request, peer string) {
	rt, ok := t.dir.(RevocationTaker)
	switch {
	case !ok:
		writePeerError(w, http.StatusNotFound, "not_found_error", "unknown_url", "this node takes no revocation statements")
		return
	case r.Method != http.MethodPost:
		writePeerError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "POST only")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 2*identity.MaxRevocationLen))
	if err != nil {
		writePeerError(w, http.StatusBadRequest, "invalid_request_error", "invalid_body", err.Error())
		return
	}
	st, err := identity.ParseRevocation(string(body))
	if err != nil {
		writePeerError(w, http.StatusBadRequest, "invalid_request_error", "invalid_revocation", err.Error())
		return
	}
	_, err = rt.AcceptRevocation(st, "quic:"+peer)
	switch {
	case errors.Is(err, identity.ErrBadRevocation):
		writePeerError(w, http.StatusForbidden, "permission_error", "untrusted_revocation", err.Error())
	case errors.Is(err, ErrStaleRevocation):
		writePeerError(w, http.StatusConflict, "invalid_request_error", "stale_revocation", err.Error())
	case err != nil:
		writePeerError(w, http.StatusConflict, "invalid_request_error", "revocation", err.Error())
	default:
		w.WriteHeader(http.StatusNoContent)
	}
}
