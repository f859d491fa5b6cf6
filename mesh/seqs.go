package mesh

import (
	"crypto/ed25519"
	"fmt"
	"maps"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
)

// Replays. A signed advert stays valid forever, and any gossip key holder
// can send it again. What keeps an old one from bringing a withdrawn role
// back:
//   - every advert carries its origin's advert set: the roles the origin
//     serves at that sequence number. A newer set that omits a role
//     withdraws it, and an advert for a role older than the newest set that
//     omits it is refused;
//   - an advert more than AdvertTTL older (by the origin's own sequence
//     numbers, which are its clock in ns) than the newest heard from that
//     origin is refused: the origin would have re-signed it since;
//   - what this node knows of each origin key is kept (bounded) and, with a
//     SeqBook, persisted, so neither the garbage collection of adverts nor a
//     restart of this node forgets it;
//   - an origin's own sequence numbers keep rising across its restarts,
//     even if its clock goes back: a floor is reserved in the SeqBook ahead
//     of use.

// OriginSeq is what this node keeps about one origin key's adverts.
type OriginSeq struct {
	Node   string   `json:"node"`
	Max    uint64   `json:"max"`     // highest sequence accepted
	SetSeq uint64   `json:"set_seq"` // sequence of the newest advert set
	Set    []string `json:"set"`     // the roles that set names
}

// SeqState is what a SeqBook persists.
type SeqState struct {
	// Reserved: this node's own sequence numbers stay above it after a
	// restart.
	Reserved uint64 `json:"reserved"`
	// Origins by base64 origin key.
	Origins map[string]OriginSeq `json:"origins"`
}

// SeqBook persists SeqState across restarts. It is used from Heal's
// goroutine only (load when Heal starts, save when changed), and may block
// on disk.
type SeqBook interface {
	LoadSeqs() (SeqState, error)
	SaveSeqs(SeqState) error
}

const (
	// maxOrigins bounds the origins remembered.
	maxOrigins = 4096
	// seqReserve is how far ahead of the clock the sequence floor is
	// reserved; it is renewed when half of it is used. After a restart our
	// sequence numbers start at most this far ahead of the clock.
	seqReserve = time.Minute
)

// originState is OriginSeq in memory, keyed by the origin key's bytes.
// Guarded by advMu.
type originState struct {
	node   string
	max    uint64
	setSeq uint64
	set    map[string]bool
}

// checkOriginLocked refuses an advert that a newer advert set or sequence
// of its origin has made stale; "" when it may be accepted.
func (m *Mesh) checkOriginLocked(key ed25519.PublicKey, body advertBody) string {
	os := m.origins[string(key)]
	if os == nil {
		return ""
	}
	if !body.Withdrawn && body.Seq < os.setSeq && !os.set[body.Role] {
		return fmt.Sprintf("sequence %d: role %q is not in the origin's newer advert set (sequence %d)", body.Seq, body.Role, os.setSeq)
	}
	if os.max > body.Seq && os.max-body.Seq > uint64(m.cfg.AdvertTTL) {
		return fmt.Sprintf("sequence %d is more than the advert TTL older than the origin's newest (%d)", body.Seq, os.max)
	}
	return ""
}

// noteOriginLocked records an accepted advert and applies its set: roles
// of the origin that the set omits, held at an older sequence, are
// withdrawn. advMu must be held.
func (m *Mesh) noteOriginLocked(key ed25519.PublicKey, body advertBody) {
	os := m.origins[string(key)]
	if os == nil {
		if len(m.origins) >= maxOrigins {
			m.dropOldestOriginLocked()
		}
		os = &originState{node: body.Origin}
		m.origins[string(key)] = os
	}
	os.node = body.Origin
	os.max = max(os.max, body.Seq)
	m.seqDirty.Store(true)
	if body.Set == nil || body.Seq <= os.setSeq {
		return
	}
	os.setSeq = body.Seq
	os.set = make(map[string]bool, len(body.Set))
	for _, r := range body.Set {
		os.set[r] = true
	}
	for k, r := range m.adverts {
		if k.origin != body.Origin || os.set[k.role] || r.withdrawn || r.seq >= body.Seq {
			continue
		}
		r.withdrawn, r.msg = true, nil
		if m.sink != nil {
			m.sink.Withdraw(k.role, k.origin)
		}
		m.log.Info("role withdrawn by its origin's newer advert set", zap.String("origin", k.origin), zap.String("role", k.role))
	}
}

// dropOldestOriginLocked forgets the origin heard from least recently (by
// its own sequence numbers, which are its clock).
func (m *Mesh) dropOldestOriginLocked() {
	var oldest string
	var min uint64
	for k, os := range m.origins {
		if oldest == "" || os.max < min {
			oldest, min = k, os.max
		}
	}
	delete(m.origins, oldest)
}

// loadSeqs applies a SeqBook's state: remembered origins, and our own
// sequence floor.
func (m *Mesh) loadSeqs(st SeqState) {
	for {
		old := m.seq.Load()
		if old >= st.Reserved || m.seq.CompareAndSwap(old, st.Reserved) {
			break
		}
	}
	m.advMu.Lock()
	defer m.advMu.Unlock()
	for k, o := range st.Origins {
		key, err := identity.ParsePublicKey(k)
		if err != nil {
			continue
		}
		os := m.origins[string(key)]
		if os == nil {
			os = &originState{node: o.Node}
			m.origins[string(key)] = os
		}
		os.max = max(os.max, o.Max)
		if o.SetSeq > os.setSeq {
			os.setSeq = o.SetSeq
			os.set = map[string]bool{}
			for _, r := range o.Set {
				os.set[r] = true
			}
		}
	}
}

// saveSeqs persists when something changed or the floor needs renewing.
func (m *Mesh) saveSeqs(book SeqBook) {
	now := uint64(time.Now().UnixNano())
	renew := m.seqReserved == 0 || now+uint64(seqReserve/2) > m.seqReserved || m.seq.Load() >= m.seqReserved
	if !renew && !m.seqDirty.Swap(false) {
		return
	}
	reserved := m.seqReserved
	if renew {
		reserved = max(now, m.seq.Load()) + uint64(seqReserve)
	}
	st := SeqState{Reserved: reserved, Origins: map[string]OriginSeq{}}
	m.advMu.Lock()
	for k, os := range m.origins {
		st.Origins[identity.EncodeKey(ed25519.PublicKey(k))] = OriginSeq{Node: os.node, Max: os.max, SetSeq: os.setSeq, Set: slices.Sorted(maps.Keys(os.set))}
	}
	m.advMu.Unlock()
	if err := book.SaveSeqs(st); err != nil {
		m.seqDirty.Store(true)
		m.log.Warn("cannot save advert sequence numbers", zap.Error(err))
		return
	}
	m.seqReserved = reserved
}
