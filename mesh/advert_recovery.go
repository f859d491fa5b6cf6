package mesh

import (
	"bytes"
	"math/rand/v2"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Early adverts and peers back alive. Gossip does not order an origin's
// alive message before its adverts: a node that comes back (restarted,
// thawed after SIGSTOP, its false death refuted) may be heard advertising
// just before it is heard alive. Such adverts are held, unverified, for
// EarlyAdvertHold (at most earlyMaxTotal of them, earlyMaxPerOrigin per
// origin) and verified once the origin is admitted; one still held when
// the time is up is refused as unknown_origin. And when gossip sees a peer
// alive again, this node re-advertises at once and exchanges every advert
// it holds with that peer (a push/pull), instead of letting both wait for
// the next refresh (AdvertTTL/3). A node that refutes a suspicion or death
// of its own re-advertises at once too: the members that held it dead
// forgot its adverts, and the gossip broadcast brings them back in
// O(log N) rounds, where their push/pulls with it are spread over
// backSpread (seconds at N=100) so as not to land all at once.

// Bounds of the early-advert hold.
const (
	EarlyAdvertHold   = 3 * time.Second
	earlyMaxTotal     = 256
	earlyMaxPerOrigin = 32
)

type earlyAdvert struct {
	msg []byte
	at  time.Time
}

// early holds adverts by origin until it is admitted or they expire.
type early struct {
	mu sync.Mutex
	by map[string][]earlyAdvert
	n  int
}

// hold keeps a copy of msg for origin; false when the bounds are reached.
func (e *early) hold(origin string, msg []byte) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n >= earlyMaxTotal || len(e.by[origin]) >= earlyMaxPerOrigin {
		return false
	}
	if e.by == nil {
		e.by = map[string][]earlyAdvert{}
	}
	e.by[origin] = append(e.by[origin], earlyAdvert{msg: bytes.Clone(msg), at: time.Now()})
	e.n++
	return true
}

// take removes and returns what is held for origin.
func (e *early) take(origin string) []earlyAdvert {
	e.mu.Lock()
	defer e.mu.Unlock()
	held := e.by[origin]
	delete(e.by, origin)
	e.n -= len(held)
	return held
}

// expired removes and returns, by origin, what was held longer than d.
func (e *early) expired(now time.Time, d time.Duration) map[string][]earlyAdvert {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out map[string][]earlyAdvert
	for origin, held := range e.by {
		keep := held[:0]
		for _, a := range held {
			if now.Sub(a.at) < d {
				keep = append(keep, a)
				continue
			}
			if out == nil {
				out = map[string][]earlyAdvert{}
			}
			out[origin] = append(out[origin], a)
			e.n--
		}
		if len(keep) == 0 {
			delete(e.by, origin)
		} else {
			e.by[origin] = keep
		}
	}
	return out
}

// releaseEarly verifies the adverts held for origin, now a member. It is
// called from memberlist's callbacks, whose locks handleAdvert's relay
// must not wait on: the work runs in a goroutine of the Mesh.
func (m *Mesh) releaseEarly(origin string) {
	held := m.early.take(origin)
	if len(held) == 0 {
		return
	}
	m.spawn(func() {
		for _, a := range held {
			m.handleAdvert(a.msg, true)
		}
	})
}

// expireEarly refuses the adverts held too long: their origin never came.
func (m *Mesh) expireEarly() {
	for origin, held := range m.early.expired(time.Now(), EarlyAdvertHold) {
		for _, a := range held {
			role := ""
			if body, _, _, err := decodeAdvert(a.msg); err == nil {
				role = body.Role
			}
			m.refuse(auditAdvertRefused, origin, role, reasonUnknownOrigin, "origin is not a live member (held "+EarlyAdvertHold.String()+")")
		}
	}
}

// peerBack re-advertises every role of ours now (new sequence numbers,
// at most once per second however many peers come back) and, when we
// forgot adverts of name's as it went, exchanges every advert held with
// it in a push/pull: we get the ones it holds, its own included, without
// waiting for its next refresh.
//
// Every member sees a peer come back at about the same time, so these
// push/pulls would all land on it at once: N-1 full-state exchanges on a
// node that was just declared dead, most likely because it was slow. On a
// loaded host that herd timed its probes out again, it was declared dead
// again, came back again, and formation of 100 nodes took minutes instead
// of seconds. So a member whose forgotten adverts do not include any of
// name's (name serves nothing: nothing to fetch; ours went out in the
// re-advertisement) does none, and the others start theirs at a random
// moment spread over backSpread.
func (m *Mesh) peerBack(name string, sent map[string]sentAdvert) {
	m.readvertise(sent)
	if !m.forgotAdvertsOf(name) {
		return
	}
	wait := rand.N(m.backSpread() + 1)
	// A push/pull is a TCP exchange bounded by memberlist's TCPTimeout:
	// not on the advertise loop.
	m.spawn(func() {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
		m.mu.RLock()
		addr, ok := m.gossipLive[name]
		m.mu.RUnlock()
		if !ok {
			return
		}
		m.stats.backPushPulls.Add(1)
		if _, err := m.ml.Join([]string{addr}); err != nil {
			m.log.Debug("cannot exchange adverts with a peer back alive", zap.String("peer", name), zap.Error(err))
			return
		}
		m.log.Debug("exchanged adverts with a peer back alive", zap.String("peer", name))
	})
}

// forgotAdvertsOf reports whether we hold adverts of origin's that we
// forgot when it left or was declared dead.
func (m *Mesh) forgotAdvertsOf(origin string) bool {
	m.advMu.Lock()
	defer m.advMu.Unlock()
	for k, r := range m.adverts {
		if k.origin == origin && r.gone {
			return true
		}
	}
	return false
}

// backSpread is the window over which the members spread their push/pulls
// with a peer back alive (peerBack): half a gossip interval per member, so
// that the peer takes about two per gossip interval whatever the mesh's
// size (10 s at N=100 with the LAN defaults: its adverts are back sooner
// on most members, and within its refresh, AdvertTTL/3, on all).
func (m *Mesh) backSpread() time.Duration {
	if m.cfg.backSpread > 0 {
		return m.cfg.backSpread
	}
	return m.cfg.GossipInterval * time.Duration(m.members.Load()) / 2
}

// readvertise re-advertises every role of ours now, with new sequence
// numbers, so that members that forgot our adverts (they held us dead, or
// we them) take them again: a gossip broadcast, O(log N) rounds, where a
// push/pull with each of them would be N-1 exchanges. At most once a
// second however often it is asked (peers coming back, our own refutes
// of a death, each of which may follow another member forgetting our
// adverts): a request within the second is done when it is up, by the
// loop's next tick.
func (m *Mesh) readvertise(sent map[string]sentAdvert) {
	now := time.Now()
	if now.Sub(m.lastBack) < time.Second {
		m.readvertiseDue = true
		return
	}
	m.lastBack, m.readvertiseDue = now, false
	for role, s := range sent {
		s.at = time.Time{}
		sent[role] = s
	}
	m.advertiseOnce(sent)
}

// noteRefuted hears that memberlist refuted a suspicion or death of this
// node: the members that declared us dead forgot our adverts, and the
// advertise loop re-advertises them (readvertise). It never blocks:
// memberlist calls it with its node lock held.
func (m *Mesh) noteRefuted() {
	m.stats.refutes.Add(1)
	select {
	case m.refuted <- struct{}{}:
	default: // one is pending: the loop re-advertises once for both
	}
}
