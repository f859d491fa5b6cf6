package mesh

import (
	"encoding/binary"
	"errors"
	"hash/fnv"
	"math/rand/v2"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Membership anti-entropy.
//
// memberlist spreads a new member by retransmitting its alive message a
// bounded number of times (RetransmitMult x log10(N+1)) and repairs what
// that missed only with its periodic push/pull, every PushPullInterval
// scaled up above 32 nodes (90 s at N=100). When many nodes join at once
// the alive messages queue behind each other in small gossip packets, a
// few members miss one, and formation waits tens of seconds for push/pull.
//
// So every node sends a membership digest (how many live members it sees
// and an order-independent hash of their names, itself included) to one
// random member every AntiEntropyInterval, and four times as often while
// membership is changing (an event in the last 10 intervals). A node whose
// own digest differs does a full push/pull (memberlist's Join with the
// sender's address): both sides end with the union of what they know. It
// costs one small packet a node per interval while views agree, and
// push/pulls only while they do not. The push/pulls a node starts are
// spaced by at least the digest interval x ceil(N/100) (a push/pull
// carries every member's state, so this bounds the bytes a node spends on
// them per second whatever N is), and the spacing doubles, up to
// PushPullInterval, for each push/pull that changed nothing we see while no
// membership event came in between, so views that stay apart for good (two
// nodes that trust differently) cost what memberlist's own push/pull does.
//
//	digest: 0x03 | live members (uvarint) | xor of fnv64a(name) (8 bytes BE) | sender name

const msgDigest byte = 0x03

const (
	// aeSpacingPer is the membership size per step of the push/pull spacing.
	aeSpacingPer = 100
	// aeFastDiv divides AntiEntropyInterval while membership is changing,
	// for aeFastFor intervals after the last change.
	aeFastDiv = 4
	aeFastFor = 10
)

// liveDigest is a set of live member names, summarized: count and the xor
// of their hashes. Equal digests mean equal sets with overwhelming
// probability; adding or removing a name is an xor.
type liveDigest struct {
	n   int
	xor uint64
}

func nameHash(name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return h.Sum64()
}

func encodeDigest(d liveDigest, self string) []byte {
	b := make([]byte, 0, 1+binary.MaxVarintLen64+8+len(self))
	b = append(b, msgDigest)
	b = binary.AppendUvarint(b, uint64(d.n))
	b = binary.BigEndian.AppendUint64(b, d.xor)
	return append(b, self...)
}

func decodeDigest(b []byte) (liveDigest, string, error) {
	if len(b) < 1 || b[0] != msgDigest {
		return liveDigest{}, "", errors.New("not a digest message")
	}
	n, k := binary.Uvarint(b[1:])
	if k <= 0 || n > 1<<24 || len(b) < 1+k+8 {
		return liveDigest{}, "", errors.New("short digest message")
	}
	xor := binary.BigEndian.Uint64(b[1+k:])
	return liveDigest{n: int(n), xor: xor}, string(b[1+k+8:]), nil
}

// digest is our own view: gossip's live members and ourselves.
func (m *Mesh) digest() liveDigest {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return liveDigest{n: len(m.gossipLive) + 1, xor: m.liveXor ^ nameHash(m.name)}
}

// handleDigest compares a member's digest with ours and, when they differ,
// asks the anti-entropy loop for a push/pull with the sender (or, when the
// sender was never a member to us, with a random one: we are the ones
// missing something). It never blocks: memberlist calls it on its receive
// path.
func (m *Mesh) handleDigest(b []byte) {
	d, from, err := decodeDigest(b)
	if err != nil {
		m.refuse(auditAdvertRefused, "", "", reasonMalformed, "digest: "+err.Error())
		return
	}
	m.stats.digestsReceived.Add(1)
	if d == m.digest() || from == m.name {
		return
	}
	select {
	case m.aeWant <- from:
	default: // one is pending; it will do
	}
}

// antiEntropyLoop sends our digest to a random member every
// AntiEntropyInterval, or a quarter of it while membership changes (with
// jitter), and does the push/pulls handleDigest asks for, spaced as the
// package comment says.
func (m *Mesh) antiEntropyLoop() {
	defer m.wg.Done()
	slow := m.cfg.AntiEntropyInterval
	fast := max(slow/aeFastDiv, time.Millisecond)
	var (
		last      time.Time // the last push/pull
		fruitless int       // push/pulls in a row that changed nothing we see
		ppEvents  int64     // membership events counted at the last push/pull
		seen      int64     // membership events counted at the last tick
		changed   time.Time // when we last saw the count move
	)
	// interval is the current one: fast while membership is changing.
	interval := func() time.Duration {
		if ev := m.liveEvents.Load(); ev != seen {
			seen, changed = ev, time.Now()
		}
		if time.Since(changed) < aeFastFor*slow {
			return fast
		}
		return slow
	}
	next := func() time.Duration {
		d := interval()
		return d/2 + rand.N(d)
	}
	t := time.NewTimer(next())
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
			m.sendDigest()
			t.Reset(next())
			continue
		case from := <-m.aeWant:
			if ev := m.liveEvents.Load(); ev != ppEvents {
				fruitless = 0 // membership moved since: views may differ for a new reason
			}
			n := int(m.members.Load())
			spacing := interval() * time.Duration((n+aeSpacingPer-1)/aeSpacingPer)
			spacing = min(spacing<<min(fruitless, 16), max(spacing, m.cfg.PushPullInterval))
			if time.Since(last) < spacing {
				continue // the next differing digest asks again
			}
			last = time.Now()
			before := m.digest()
			m.antiEntropyPushPull(from)
			ppEvents = m.liveEvents.Load()
			if m.digest() == before {
				fruitless++
			} else {
				fruitless = 0
			}
		}
	}
}

// sendDigest sends our digest to one random live member.
func (m *Mesh) sendDigest() {
	name, addr := m.randomLive()
	if addr == "" {
		return
	}
	msg := encodeDigest(m.digest(), m.name)
	if err := m.ml.SendToAddress(memberlist.Address{Addr: addr, Name: name}, msg); err != nil {
		m.log.Debug("membership digest not sent", zap.String("peer", name), zap.Error(err))
		return
	}
	m.stats.digestsSent.Add(1)
}

// antiEntropyPushPull does a full push/pull with from, or with a random
// live member when from is not one and never was.
//
// A sender we hold as dead or left is the one missing something: that it
// was declared dead. Gossip may never tell it (the dead broadcast is
// retransmitted a bounded number of times, and not re-sent by members
// that already hold it dead), our own digests skip it, and a push/pull
// with a third member changes nothing (an alive at the incarnation we hold
// dead is ignored), so before, the views stayed apart, the spacing backed
// off to PushPullInterval, and a formation under load waited minutes. Our
// state tells it; it refutes with a higher incarnation that gossip then
// spreads.
func (m *Mesh) antiEntropyPushPull(from string) {
	m.mu.RLock()
	addr := m.gossipLive[from]
	if p := m.departed[from]; addr == "" && p != nil {
		addr = p.addr
	}
	m.mu.RUnlock()
	if addr == "" {
		from, addr = m.randomLive()
		if addr == "" {
			return
		}
	}
	m.stats.antiEntropyPushPulls.Add(1)
	if _, err := m.ml.Join([]string{addr}); err != nil {
		m.log.Debug("anti-entropy push/pull failed", zap.String("peer", from), zap.Error(err))
	}
}

// randomLive picks a live member other than us, uniformly; "" when none.
func (m *Mesh) randomLive() (name, addr string) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if len(m.gossipLive) == 0 {
		return "", ""
	}
	skip := rand.N(len(m.gossipLive))
	for k, v := range m.gossipLive {
		if skip == 0 {
			return k, v
		}
		skip--
	}
	return "", ""
}
