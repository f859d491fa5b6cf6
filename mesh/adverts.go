package mesh

import (
	"bytes"
	"cmp"
	"crypto/ed25519"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/placement"
)

// Wire format. Every gossip user message starts with its type byte.
//
//	advert: 0x01 | body length (uint16 BE) | body (JSON advertBody) | ed25519 signature
//	state:  0x02 | count (uvarint) | count x (length (uvarint) | advert message)
//	        [ | revocation statements (revocations.go) ]
//
// The signature is by the origin's node key over advertDomain + body; the
// body names the cluster, so an advert cannot be replayed into another one.
const (
	msgAdvert    byte = 0x01
	msgState     byte = 0x02
	advertDomain      = "infermesh/advert/v1\x00"
	// maxAdvertMsg keeps an advert well inside one UDP gossip packet.
	maxAdvertMsg = 1024
)

// advertBody is what an origin signs.
type advertBody struct {
	Cluster   string   `json:"cluster"`
	Origin    string   `json:"origin"`
	Role      string   `json:"role"`
	Seq       uint64   `json:"seq"`
	Withdrawn bool     `json:"withdrawn,omitempty"`
	API       string   `json:"api,omitempty"`
	Runtime   string   `json:"runtime,omitempty"`
	Model     string   `json:"model,omitempty"`
	Load      uint32   `json:"load,omitempty"`
	Methods   []string `json:"methods,omitempty"`
	// Cap is the instance's capacity and use (placement.Capacity), absent
	// when unknown. Nodes of earlier versions ignore it.
	Cap *advertCap `json:"cap,omitempty"`
	// Set is the origin's advert set at Seq: every role it serves. A
	// newer set that omits a role withdraws it. Nil (absent) when the set
	// would not fit in one advert.
	Set []string `json:"set"`
}

// advertCap is placement.Capacity in an advert, with short names: it is
// sent in every refresh of a busy role.
type advertCap struct {
	Slots   uint32  `json:"s,omitempty"`
	Running uint32  `json:"r,omitempty"`
	Waiting uint32  `json:"w,omitempty"`
	KV      float32 `json:"kv,omitempty"`
	Cache   uint32  `json:"c,omitempty"` // tokens the KV cache holds
	// Hit is the prefix cache hit ratio, in hundredths; absent when the
	// engine counts none (0 is a ratio).
	Hit *float32 `json:"h,omitempty"`
}

func capOf(c placement.Capacity) *advertCap {
	if !c.Known() {
		return nil
	}
	ac := &advertCap{Slots: c.Slots, Running: c.Running, Waiting: c.Waiting, KV: c.KVUsage, Cache: c.CacheTokens}
	if c.HasCacheHit {
		h := c.CacheHit
		ac.Hit = &h
	}
	return ac
}

func (b advertBody) advert() placement.Advert {
	ad := placement.Advert{
		Name: placement.ServicePrefix + b.Role, Node: b.Origin,
		API: b.API, Runtime: b.Runtime, Model: b.Model, Load: b.Load,
		Methods: slices.Clone(b.Methods),
	}
	if c := b.Cap; c != nil {
		kv := c.KV
		if !(kv >= 0) { // NaN, or negative: a hostile or broken origin
			kv = 0
		}
		ad.Capacity = placement.Capacity{Slots: c.Slots, Running: c.Running, Waiting: c.Waiting, KVUsage: min(kv, 1), CacheTokens: c.Cache}
		if c.Hit != nil {
			ad.Capacity.CacheHit, ad.Capacity.HasCacheHit = placement.RoundCacheHit(float64(*c.Hit)), true
		}
	}
	return ad
}

func encodeAdvert(body advertBody, priv ed25519.PrivateKey) ([]byte, error) {
	j, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	n := 1 + 2 + len(j) + ed25519.SignatureSize
	if n > maxAdvertMsg {
		return nil, fmt.Errorf("advert for role %q is %d bytes, more than %d", body.Role, n, maxAdvertMsg)
	}
	msg := make([]byte, 0, n)
	msg = append(msg, msgAdvert)
	msg = binary.BigEndian.AppendUint16(msg, uint16(len(j)))
	msg = append(msg, j...)
	sig := ed25519.Sign(priv, append([]byte(advertDomain), j...))
	return append(msg, sig...), nil
}

// decodeAdvert splits an advert message. It does not verify the signature.
func decodeAdvert(msg []byte) (body advertBody, signed, sig []byte, err error) {
	if len(msg) < 3+ed25519.SignatureSize || msg[0] != msgAdvert {
		return body, nil, nil, errors.New("short advert message")
	}
	n := int(binary.BigEndian.Uint16(msg[1:3]))
	if len(msg) != 3+n+ed25519.SignatureSize {
		return body, nil, nil, fmt.Errorf("advert message length %d does not match body length %d", len(msg), n)
	}
	j := msg[3 : 3+n]
	if err := json.Unmarshal(j, &body); err != nil {
		return body, nil, nil, fmt.Errorf("advert body: %w", err)
	}
	return body, append([]byte(advertDomain), j...), msg[3+n:], nil
}

// advertBroadcast is a queued advert. Named by origin and role, so a newer
// advert replaces the queued older one.
type advertBroadcast struct {
	name string
	msg  []byte
}

var _ memberlist.NamedBroadcast = (*advertBroadcast)(nil)

func (b *advertBroadcast) Name() string    { return b.name }
func (b *advertBroadcast) Message() []byte { return b.msg }
func (b *advertBroadcast) Finished()       {}

// Invalidates follows NamedBroadcast's contract: same name, same advert slot.
func (b *advertBroadcast) Invalidates(o memberlist.Broadcast) bool {
	nb, ok := o.(memberlist.NamedBroadcast)
	return ok && nb.Name() == b.name
}

type advertKey struct{ origin, role string }

// advertRecord is the newest advert we accepted for an origin and role. Its
// seq is the high-water mark against replays; it outlives the origin's
// departure (gone) for a while so an old advert cannot come back.
type advertRecord struct {
	seq       uint64
	msg       []byte // nil once gone
	withdrawn bool
	received  time.Time
	gone      bool // origin left, died or is no longer admitted
	// unlisted: the sink refused it, its origin not allowlisted for the
	// role; ReofferUnlisted offers it again once the policy changed.
	unlisted bool
}

// handleAdvert verifies and applies one advert message; relay re-broadcasts
// it when it was new to us (gossip, not push/pull).
func (m *Mesh) handleAdvert(msg []byte, relay bool) {
	body, signed, sig, err := decodeAdvert(msg)
	if err != nil {
		m.refuse(auditAdvertRefused, "", "", reasonMalformed, err.Error())
		return
	}
	origin, role := body.Origin, body.Role
	if body.Cluster != m.cfg.Cluster {
		m.refuse(auditAdvertRefused, origin, role, reasonWrongCluster,
			fmt.Sprintf("advert for cluster %q, we are in %q", body.Cluster, m.cfg.Cluster))
		return
	}
	if origin == m.name {
		return // our own, echoed back by gossip
	}
	if err := placement.ValidateRole(role); err != nil {
		m.refuse(auditAdvertRefused, origin, role, reasonMalformed, err.Error())
		return
	}
	if err := identity.ValidateNodeName(origin); err != nil {
		m.refuse(auditAdvertRefused, "", role, reasonMalformed, err.Error())
		return
	}
	// Verify against the origin's admitted key: whoever relayed the message
	// to us is irrelevant.
	scope, why, p := m.scopeOf(origin)
	switch {
	case p == nil:
		if !m.early.hold(origin, msg) {
			m.refuse(auditAdvertRefused, origin, role, reasonUnknownOrigin, "origin is not a live member (too many early adverts held)")
		}
		return
	case scope == 0:
		m.refuse(auditAdvertRefused, origin, role, reasonUnadmitted, why)
		return
	case !ed25519.Verify(p.meta.key, signed, sig):
		m.refuse(auditAdvertRefused, origin, role, reasonBadSignature, "signature is not by the origin's key")
		return
	case scope != identity.ScopeFull:
		m.refuse(auditAdvertRefused, origin, role, reasonNotFullScope, "origin is admitted as "+scope.String())
		return
	}

	k := advertKey{origin, role}
	var ingestErr error
	m.advMu.Lock()
	m.mu.RLock()
	cur, dropped := m.peers[origin], m.removed[origin]
	m.mu.RUnlock()
	if cur == nil || !cur.meta.key.Equal(p.meta.key) {
		m.advMu.Unlock() // it left while we verified
		m.refuse(auditAdvertRefused, origin, role, reasonUnknownOrigin, "origin left")
		return
	}
	if dropped {
		// Revoked (or its trust changed) while we verified: enforceAdmission
		// already removed it from placement and must not be undone.
		m.advMu.Unlock()
		m.refuse(auditAdvertRefused, origin, role, reasonUnadmitted, "no longer admitted")
		return
	}
	rec := m.adverts[k]
	if rec != nil && body.Seq == rec.seq && !rec.gone {
		m.advMu.Unlock() // a copy we already have: gossip repeats itself
		return
	}
	if rec != nil && body.Seq < rec.seq {
		m.advMu.Unlock()
		m.refuse(auditAdvertRefused, origin, role, reasonStale,
			fmt.Sprintf("sequence %d, already have %d", body.Seq, rec.seq))
		return
	}
	if why := m.checkOriginLocked(p.meta.key, body); why != "" {
		m.advMu.Unlock()
		m.refuse(auditAdvertRefused, origin, role, reasonStale, why)
		return
	}
	// Only a strictly newer sequence number gets here: only it refreshes
	// the TTL in placement. The record (and the relay below) keep their own
	// copy: memberlist reuses NotifyMsg's buffer, and a push/pull buffer
	// holds every other advert too.
	msg = bytes.Clone(msg)
	rec = &advertRecord{seq: body.Seq, msg: msg, withdrawn: body.Withdrawn, received: time.Now()}
	m.adverts[k] = rec
	m.noteOriginLocked(p.meta.key, body)
	if m.sink != nil {
		if body.Withdrawn {
			m.sink.Withdraw(role, origin)
		} else {
			ingestErr = m.sink.IngestAdvertisement(origin, body.advert())
			rec.unlisted = isUnlisted(ingestErr)
		}
	}
	m.advMu.Unlock()
	if ingestErr != nil {
		m.countPlacement(ingestErr)
	}
	if relay {
		m.bcast.QueueBroadcast(&advertBroadcast{name: "advert/" + origin + "/" + role, msg: msg})
	}
}

func isUnlisted(err error) bool {
	var re *placement.RefusedError
	return errors.As(err, &re) && re.Reason == placement.ReasonNotAllowlisted
}

// ReofferUnlisted offers the sink again origin's advert of role if the
// sink refused it because origin was not allowlisted for the role, and
// reports whether it took it now. Call it when the sink's allowlist let
// origin in: an advert is otherwise heard again only at its origin's next
// refresh, as a copy of one already held is not offered twice. (At
// start-up, a peer's push/pull can arrive before the stored policy is
// applied.) An advert whose TTL ran out since its receipt is not offered:
// its origin's next refresh brings it back. Placement counts a re-offered
// advert's TTL from the re-offer, at most one TTL past its receipt; its
// origin refreshes well within that.
func (m *Mesh) ReofferUnlisted(role, origin string) bool {
	if m.sink == nil {
		return false
	}
	m.advMu.Lock()
	defer m.advMu.Unlock()
	r := m.adverts[advertKey{origin, role}]
	if r == nil || !r.unlisted || r.gone || r.withdrawn || r.msg == nil || time.Since(r.received) > m.cfg.AdvertTTL {
		return false
	}
	body, _, _, err := decodeAdvert(r.msg)
	if err != nil {
		return false // verified at its receipt: cannot happen
	}
	err = m.sink.IngestAdvertisement(origin, body.advert())
	if r.unlisted = isUnlisted(err); err != nil {
		m.countPlacement(err)
		return false
	}
	return true
}

// HeldAdvert is a peer's fresh advert this node holds, placed or not.
type HeldAdvert struct {
	Origin, Role string
	Advert       placement.Advert
	Received     time.Time
	// Unlisted: placement refused it, its origin not allowlisted for the
	// role on this node.
	Unlisted bool
}

// HeldAdverts lists the fresh, not withdrawn adverts of peers this node
// holds, sorted by origin then role: what each peer serves, whether or
// not this node lets it serve it here (an operator's view; placement's
// table holds only the adverts it took).
func (m *Mesh) HeldAdverts() []HeldAdvert {
	now := time.Now()
	var out []HeldAdvert
	m.advMu.Lock()
	for k, r := range m.adverts {
		if k.origin == m.name || r.gone || r.withdrawn || r.msg == nil || now.Sub(r.received) > m.cfg.AdvertTTL {
			continue
		}
		body, _, _, err := decodeAdvert(r.msg)
		if err != nil {
			continue // verified at its receipt: cannot happen
		}
		out = append(out, HeldAdvert{Origin: k.origin, Role: k.role, Advert: body.advert(), Received: r.received, Unlisted: r.unlisted})
	}
	m.advMu.Unlock()
	slices.SortFunc(out, func(a, b HeldAdvert) int {
		return cmp.Or(strings.Compare(a.Origin, b.Origin), strings.Compare(a.Role, b.Role))
	})
	return out
}

// forgetOriginLocked drops what origin advertised from push/pull state,
// keeping the sequence high-water marks. advMu must be held.
func (m *Mesh) forgetOriginLocked(origin string) {
	for k, r := range m.adverts {
		if k.origin == origin {
			r.gone, r.msg = true, nil
		}
	}
}

// localState encodes every fresh advert we hold, ours included, for a
// push/pull, then the revocation statements.
func (m *Mesh) localState() []byte {
	now := time.Now()
	var msgs [][]byte
	size := 1 + binary.MaxVarintLen64
	m.advMu.Lock()
	for _, r := range m.adverts {
		if r.gone || r.msg == nil || now.Sub(r.received) > m.cfg.AdvertTTL {
			continue
		}
		msgs = append(msgs, r.msg)
		size += binary.MaxVarintLen64 + len(r.msg)
	}
	m.advMu.Unlock()
	return m.appendRevocations(appendSection(make([]byte, 0, size), msgState, msgs))
}

// mergeState applies the adverts of a peer's push/pull state, then its
// revocation statements. They are not relayed: push/pull already reaches
// everyone in turn.
func (m *Mesh) mergeState(b []byte) {
	if len(b) == 0 {
		return
	}
	rest, bad := readSection(b, msgState, func(msg []byte) { m.handleAdvert(msg, false) })
	if bad != "" {
		m.refuse(auditAdvertRefused, "", "", reasonMalformed, "push/pull state: "+bad)
		return
	}
	m.mergeRevocations(rest)
}

// appendSection appends a section of push/pull state to b:
//
//	typ | count (uvarint) | count x (length (uvarint) | message)
func appendSection(b []byte, typ byte, msgs [][]byte) []byte {
	b = append(b, typ)
	b = binary.AppendUvarint(b, uint64(len(msgs)))
	for _, msg := range msgs {
		b = binary.AppendUvarint(b, uint64(len(msg)))
		b = append(b, msg...)
	}
	return b
}

// readSection calls f with each message of the section of type typ that
// b starts with, and returns what follows the section; bad says what was
// malformed, "" when nothing was. f must copy what it keeps.
func readSection(b []byte, typ byte, f func([]byte)) (rest []byte, bad string) {
	if len(b) == 0 || b[0] != typ {
		return nil, "section of unknown type"
	}
	b = b[1:]
	count, n := binary.Uvarint(b)
	if n <= 0 {
		return nil, "bad count"
	}
	b = b[n:]
	for range count {
		l, n := binary.Uvarint(b)
		if n <= 0 || l > uint64(len(b)-n) {
			return nil, "truncated"
		}
		f(b[n : n+int(l)])
		b = b[n+int(l):]
	}
	return b, ""
}

// nextSeq returns a sequence number greater than every one used before,
// also across restarts (it never falls below the wall clock in ns).
func (m *Mesh) nextSeq() uint64 {
	for {
		old := m.seq.Load()
		n := max(old+1, uint64(time.Now().UnixNano()))
		if m.seq.CompareAndSwap(old, n) {
			return n
		}
	}
}

// publish signs, records and broadcasts one of our adverts.
func (m *Mesh) publish(body advertBody) (int, error) {
	body.Cluster, body.Origin, body.Seq = m.cfg.Cluster, m.name, m.nextSeq()
	msg, err := encodeAdvert(body, m.priv)
	if err != nil && body.Set != nil {
		// Too many roles for the set to fit: send the advert alone.
		body.Set = nil
		msg, err = encodeAdvert(body, m.priv)
	}
	if err != nil {
		return 0, err
	}
	m.advMu.Lock()
	m.adverts[advertKey{m.name, body.Role}] = &advertRecord{seq: body.Seq, msg: msg, withdrawn: body.Withdrawn, received: time.Now()}
	m.advMu.Unlock()
	m.bcast.QueueBroadcast(&advertBroadcast{name: "advert/" + m.name + "/" + body.Role, msg: msg})
	return len(msg), nil
}

// DefaultAdvertLoadBudget is Config.AdvertLoadBudget's default.
const DefaultAdvertLoadBudget = 400

// loadAdvertInterval is how often a change of load alone may be
// advertised: an advert of size bytes costs each of members nodes about
// mult x ceil(log10(members+1)) sends of it (memberlist's retransmit
// limit), and that over budget bytes a second is the interval; at least a
// second, at most refresh (when the advert is sent anyway).
func loadAdvertInterval(size, members, mult, budget int, refresh time.Duration) time.Duration {
	if budget <= 0 || size <= 0 {
		return min(refresh, time.Second)
	}
	sends := float64(mult) * math.Ceil(math.Log10(float64(max(members, 1))+1))
	d := time.Duration(float64(size) * sends / float64(budget) * float64(time.Second))
	return min(max(d, time.Second), refresh)
}

type sentAdvert struct {
	ad   placement.Advert
	at   time.Time
	size int // the advert's bytes as sent
	// withdrawn is when the role was withdrawn (zero while it is served).
	// A withdrawal is a broadcast like any advert and can miss a node, so
	// it is sent again every AdvertTTL/3 until a TTL has passed (by then
	// every receiver has expired the role anyway).
	withdrawn time.Time
}

// advertiseLoop compares our local roles with what we advertised every
// gossip interval: a new or changed role is advertised at once, a role no
// longer served is withdrawn (signed), and every advert is re-signed with a
// new sequence number every AdvertTTL/3 so receivers keep it fresh. It
// also enforces admission (certificate expiry) and collects old records.
func (m *Mesh) advertiseLoop() {
	defer m.wg.Done()
	t := time.NewTicker(m.cfg.GossipInterval)
	defer t.Stop()
	sent := map[string]sentAdvert{}
	lastGC := time.Now()
	m.advertiseOnce(sent)
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		case name := <-m.back:
			m.peerBack(name, sent)
			continue
		case <-m.refuted:
			m.readvertise(sent)
			continue
		}
		if m.readvertiseDue {
			m.readvertise(sent)
		}
		m.advertiseOnce(sent)
		m.gossipStarvedAdverts()
		m.expireEarly()
		m.enforceAdmission()
		if time.Since(lastGC) >= m.cfg.AdvertTTL/3 {
			m.gc()
			lastGC = time.Now()
		}
	}
}

func (m *Mesh) advertiseOnce(sent map[string]sentAdvert) {
	defer m.stats.advertRounds.Add(1)
	if m.sink == nil {
		return
	}
	if m.selfScope() != identity.ScopeFull {
		// Consumers may not serve: nobody would hear our adverts.
		return
	}
	now := time.Now()
	refresh := m.cfg.AdvertTTL / 3
	members := int(m.members.Load())
	ads := m.sink.Advertisements()
	seen := map[string]bool{}
	var set []string
	for _, ad := range ads {
		if role := ad.Role(); role != "" && ad.Node == m.name {
			seen[role] = true
			set = append(set, role)
		}
	}
	slices.Sort(set)
	set = append([]string{}, set...) // never nil: an empty set withdraws every role
	for _, ad := range ads {
		role := ad.Role()
		if role == "" || ad.Node != m.name {
			continue
		}
		prev, ok := sent[role]
		age := now.Sub(prev.at)
		loadChanged := prev.ad.Load != ad.Load || prev.ad.Capacity != ad.Capacity
		loadRefresh := loadAdvertInterval(prev.size, members, m.cfg.RetransmitMult, m.cfg.AdvertLoadBudget, refresh)
		due := !ok || !prev.withdrawn.IsZero() || age >= refresh || !sameButLoad(prev.ad, ad) || (loadChanged && age >= loadRefresh)
		if !due {
			continue
		}
		size, err := m.publish(advertBody{Role: role, API: ad.API, Runtime: ad.Runtime, Model: ad.Model, Load: ad.Load, Methods: ad.Methods, Set: set, Cap: capOf(ad.Capacity)})
		if err != nil {
			m.log.Warn("cannot advertise role", zap.String("role", role), zap.Error(err))
			continue
		}
		sent[role] = sentAdvert{ad: ad, at: now, size: size}
	}
	for role, prev := range sent {
		if seen[role] {
			continue
		}
		first := prev.withdrawn.IsZero()
		switch {
		case !first && now.Sub(prev.withdrawn) >= m.cfg.AdvertTTL:
			delete(sent, role)
			continue
		case !first && now.Sub(prev.at) < refresh:
			continue
		}
		if _, err := m.publish(advertBody{Role: role, Withdrawn: true, Set: set}); err != nil {
			m.log.Warn("cannot withdraw role", zap.String("role", role), zap.Error(err))
			continue
		}
		prev.at = now
		if first {
			prev.withdrawn = now
			m.log.Info("withdrew role", zap.String("role", role))
		}
		sent[role] = prev
	}
}

// sameButLoad: a and b differ at most in their load and capacity, which
// are sent within the load adverts' budget (loadAdvertInterval).
func sameButLoad(a, b placement.Advert) bool {
	return a.Name == b.Name && a.Node == b.Node && a.API == b.API && a.Runtime == b.Runtime &&
		a.Model == b.Model && slices.Equal(a.Methods, b.Methods)
}

// gc drops records nobody needs: gone or of non-members, and older than
// three TTLs (by then the origin, if back, advertises with a newer
// sequence number anyway). Records of live members are kept as high-water
// marks.
func (m *Mesh) gc() {
	now := time.Now()
	m.advMu.Lock()
	defer m.advMu.Unlock()
	m.mu.RLock()
	defer m.mu.RUnlock()
	for k, r := range m.adverts {
		if k.origin == m.name {
			if r.withdrawn && now.Sub(r.received) > 3*m.cfg.AdvertTTL {
				delete(m.adverts, k)
			}
			continue
		}
		if _, live := m.peers[k.origin]; (r.gone || !live) && now.Sub(r.received) > 3*m.cfg.AdvertTTL {
			delete(m.adverts, k)
		}
	}
}
