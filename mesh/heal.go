package mesh

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Healing. memberlist gossips and push/pulls only with the members it
// believes alive (and, for GossipToTheDeadTime, the recently dead): once
// two sides of a partition have declared each other dead, or a restarted
// node that was given no join address comes back, nothing brings them
// together again. Heal does what Consul's retry_join and serf's reconnect
// do: it keeps contacting, with a per-address backoff, every configured
// join address and every peer this node has seen (the PeerBook keeps
// those across restarts) that is not a live member right now. One push/pull
// with the other side is enough to merge: each side learns the other is
// alive (or refutes its own death, and the next contact carries the
// refutation).

// KnownPeer is a peer this node has seen alive, as the PeerBook keeps it.
type KnownPeer struct {
	Name     string    `json:"name"`
	Addr     string    `json:"addr"` // gossip address, host:port
	LastSeen time.Time `json:"last_seen"`
}

// PeerBook persists the peers Heal contacts across restarts. Load is called
// once when Heal starts; Save with the whole list whenever it changed (at
// most once per RejoinInterval). Both are called from Heal's goroutine
// only, never concurrently, and may block on disk.
type PeerBook interface {
	LoadPeers() ([]KnownPeer, error)
	SavePeers([]KnownPeer) error
}

// Defaults of healing.
const (
	DefaultRejoinInterval   = 2 * time.Second
	DefaultRejoinMaxBackoff = 15 * time.Second
	// DefaultReconnectTimeout is how long a peer not seen is still
	// contacted (serf's reconnect_timeout).
	DefaultReconnectTimeout = 72 * time.Hour
	// maxKnownPeers bounds the PeerBook.
	maxKnownPeers = 256
)

// rejoinTarget is one address Heal contacts while it is not a live member.
type rejoinTarget struct {
	name       string // "" for a configured address not yet matched to a node
	configured bool
	lastSeen   time.Time
	backoff    time.Duration
	next       time.Time
	busy       bool // an attempt is running
	refused    bool // the last attempt was refused for good (logged once)
}

// healer is Heal's state; only Heal's goroutine and its attempts touch it,
// under mu.
type healer struct {
	mu      sync.Mutex
	targets map[string]*rejoinTarget // by address
	dirty   bool
	joined  bool // a contact succeeded since Heal started
}

// HealOptions are Heal's companions; every field may be nil.
type HealOptions struct {
	// Peers keeps the peers to rejoin across restarts.
	Peers PeerBook
	// Seqs keeps advert sequence numbers across restarts (see SeqState).
	Seqs SeqBook
	// OnJoin is called after every successful contact, with the address
	// and the number of live members.
	OnJoin func(addr string, members int)
	// OnRefused is called after a permanent refusal (ErrJoinRefused).
	OnRefused func(addr string, err error)
	// OnFirstRound is called once, when the first round of contacts has
	// ended: every configured join address and saved peer was contacted
	// once (or there was none to contact, or this node's own certificate
	// has expired). targets is how many were contacted; joined says
	// whether one answered, so that the node knows its peers and what
	// they serve. Later successes are OnJoin's.
	OnFirstRound func(targets int, joined bool)
}

// Heal joins the mesh and keeps it whole until ctx ends or the Mesh
// closes: every RejoinInterval it contacts each configured join address
// and each known peer that is not a live member, each on its own doubling
// backoff (RejoinInterval up to RejoinMaxBackoff, with jitter). It also
// loads and saves the books of o. Heal blocks; it returns nil when ctx ends
// and ErrClosed when the Mesh closes. Run one Heal per Mesh.
func (m *Mesh) Heal(ctx context.Context, o HealOptions) error {
	h := &m.heal
	now := time.Now()
	book, onJoin, onRefused := o.Peers, o.OnJoin, o.OnRefused
	if o.Seqs != nil {
		st, err := o.Seqs.LoadSeqs()
		if err != nil {
			m.log.Warn("cannot load advert sequence numbers", zap.Error(err))
		}
		m.loadSeqs(st)
		m.saveSeqs(o.Seqs) // reserve our floor before joining
	}
	h.mu.Lock()
	for _, a := range m.cfg.Join {
		h.addLocked(a, "", true, time.Time{})
	}
	h.mu.Unlock()
	if book != nil {
		known, err := book.LoadPeers()
		if err != nil {
			m.log.Warn("cannot load known peers; rejoining configured addresses only", zap.Error(err))
		}
		h.mu.Lock()
		for _, p := range known {
			if now.Sub(p.LastSeen) < m.cfg.ReconnectTimeout && p.Name != m.name {
				h.addLocked(p.Addr, p.Name, false, p.LastSeen)
			}
		}
		h.mu.Unlock()
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(min(m.cfg.RejoinInterval, time.Second))
	defer tick.Stop()
	lastSave, lastCertWarn := time.Time{}, time.Time{}
	for round := 0; ; round++ {
		var first sync.WaitGroup
		targets := 0
		if !m.ownCertExpired(&lastCertWarn) {
			rwg := &wg
			if round == 0 {
				rwg = &first
			}
			// The first round also contacts a peer gossip already lists
			// as live unless some push/pull has been merged: that peer
			// may be live here by its own contact, whose state (what it
			// serves) is not merged yet, and readiness waits for it.
			targets = m.healRound(ctx, rwg, round == 0 && !m.merged.Load(), onJoin, onRefused)
		}
		if round == 0 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				first.Wait()
				h.mu.Lock()
				joined := h.joined
				h.mu.Unlock()
				// A peer's own contact merged counts as joined too.
				joined = joined || m.merged.Load()
				if o.OnFirstRound != nil {
					o.OnFirstRound(targets, joined)
				}
			}()
		}
		if o.Seqs != nil {
			m.saveSeqs(o.Seqs)
		}
		if book != nil && time.Since(lastSave) >= m.cfg.RejoinInterval {
			if list, changed := m.knownPeers(); changed {
				if err := book.SavePeers(list); err != nil {
					m.log.Warn("cannot save known peers", zap.Error(err))
				}
				lastSave = time.Now()
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-m.ctx.Done():
			return ErrClosed
		case <-tick.C:
		}
	}
}

// JoinNow contacts addrs once each, now, and adds them to the addresses
// Heal keeps contacting (`infermesh join`). It returns how many contacts
// succeeded; the error wraps ErrJoinRefused when one refused us for good.
func (m *Mesh) JoinNow(addrs []string) (int, error) {
	h := &m.heal
	h.mu.Lock()
	for _, a := range addrs {
		h.addLocked(a, "", true, time.Time{})
	}
	h.mu.Unlock()
	m.joinRefusal.Store(nil)
	n, err := m.ml.Join(addrs)
	if n > 0 {
		m.log.Info("joined the mesh", zap.Strings("addrs", addrs), zap.Int("contacts", n), zap.Int("members", m.ml.NumMembers()))
		return n, nil
	}
	if p := m.joinRefusal.Load(); p != nil {
		return 0, fmt.Errorf("%w: %w", ErrJoinRefused, *p)
	}
	return 0, err
}

func (h *healer) addLocked(addr, name string, configured bool, seen time.Time) {
	t := h.targets[addr]
	if t == nil {
		t = &rejoinTarget{}
		h.targets[addr] = t
		h.dirty = h.dirty || name != ""
	}
	if name != "" && t.name != name {
		t.name = name
		h.dirty = true
	}
	t.configured = t.configured || configured
	if seen.After(t.lastSeen) {
		// LastSeen is persisted coarsely: an hour is far below the
		// reconnect timeout it is compared with.
		h.dirty = h.dirty || seen.Sub(t.lastSeen) > time.Hour
		t.lastSeen = seen
	}
}

// healRound starts an attempt for every due target that is not a live
// member, and returns how many it started. Live peers are recorded as
// known (their address may change).
func (m *Mesh) healRound(ctx context.Context, wg *sync.WaitGroup, contactLive bool, onJoin func(string, int), onRefused func(string, error)) int {
	started := 0
	now := time.Now()
	liveAddr := map[string]bool{}
	liveName := map[string]bool{}
	type seen struct{ name, addr string }
	var live []seen
	// Live as memberlist sees it: a peer kept because it answered over
	// QUIC while gossip calls it dead still needs the gossip merged.
	m.mu.RLock()
	for name, addr := range m.gossipLive {
		liveAddr[addr], liveName[name] = true, true
		live = append(live, seen{name, addr})
	}
	t := m.trust
	revoked := map[string]bool{}
	for _, p := range m.departed {
		if t.revoked(p.name, p.meta.key) {
			revoked[p.name] = true
		}
	}
	m.mu.RUnlock()

	h := &m.heal
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range live {
		// A node that moved: its old address is no longer it.
		for a, tg := range h.targets {
			if tg.name == s.name && a != s.addr && !tg.configured {
				delete(h.targets, a)
				h.dirty = true
			}
		}
		h.addLocked(s.addr, s.name, false, now)
	}
	for addr, tg := range h.targets {
		switch {
		case !contactLive && (liveAddr[addr] || (tg.name != "" && liveName[tg.name])):
			tg.backoff, tg.next, tg.refused = 0, time.Time{}, false
			continue
		case tg.name != "" && revoked[tg.name]:
			continue
		case !tg.configured && now.Sub(tg.lastSeen) > m.cfg.ReconnectTimeout:
			delete(h.targets, addr)
			h.dirty = true
			continue
		case tg.busy || now.Before(tg.next):
			continue
		}
		tg.busy = true
		started++
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.rejoin(ctx, addr, onJoin, onRefused)
		}()
	}
	return started
}

// rejoin makes one contact with addr and sets its next attempt.
func (m *Mesh) rejoin(ctx context.Context, addr string, onJoin func(string, int), onRefused func(string, error)) {
	if ctx.Err() != nil || m.ctx.Err() != nil {
		m.heal.mu.Lock()
		if tg := m.heal.targets[addr]; tg != nil {
			tg.busy = false
		}
		m.heal.mu.Unlock()
		return
	}
	n, err := m.ml.Join([]string{addr})
	var refusal error
	if p := m.joinRefusal.Load(); n == 0 && p != nil {
		refusal = fmt.Errorf("%w: %w", ErrJoinRefused, *p)
		m.joinRefusal.Store(nil)
	}
	h := &m.heal
	h.mu.Lock()
	tg := h.targets[addr]
	if tg == nil {
		h.mu.Unlock()
		return
	}
	tg.busy = false
	first := false
	if n > 0 {
		tg.backoff, tg.refused = 0, false
		first = !h.joined
		h.joined = true
		// Contacted but perhaps not yet merged (a refuted death spreads on
		// the next contact): check again soon.
		tg.next = time.Now().Add(m.cfg.RejoinInterval)
		h.mu.Unlock()
		members := m.ml.NumMembers()
		if first {
			m.log.Info("joined the mesh", zap.String("addr", addr), zap.Int("members", members))
		} else {
			m.log.Info("rejoined a peer", zap.String("addr", addr), zap.Int("members", members))
		}
		if onJoin != nil {
			onJoin(addr, members)
		}
		return
	}
	tg.backoff = min(cmp.Or(tg.backoff*2, m.cfg.RejoinInterval), m.cfg.RejoinMaxBackoff)
	tg.next = time.Now().Add(tg.backoff + rand.N(tg.backoff/4+1))
	logRefusal := refusal != nil && !tg.refused
	tg.refused = refusal != nil
	backoff := tg.backoff
	h.mu.Unlock()
	switch {
	case logRefusal:
		m.log.Error("a peer refused this node; still retrying", zap.String("addr", addr), zap.Error(refusal))
		if onRefused != nil {
			onRefused(addr, refusal)
		}
	case refusal == nil && !errors.Is(err, ErrClosed):
		m.log.Debug("rejoin failed", zap.String("addr", addr), zap.Duration("next_in", backoff), zap.Error(err))
	}
}

// knownPeers returns the peers to persist (named targets, most recently
// seen first, bounded) and whether they changed since the last call.
func (m *Mesh) knownPeers() ([]KnownPeer, bool) {
	h := &m.heal
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []KnownPeer
	for a, tg := range h.targets {
		if tg.name != "" {
			out = append(out, KnownPeer{Name: tg.name, Addr: a, LastSeen: tg.lastSeen})
		}
	}
	changed := h.dirty
	h.dirty = false
	slices.SortFunc(out, func(a, b KnownPeer) int {
		if c := b.LastSeen.Compare(a.LastSeen); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	if len(out) > maxKnownPeers {
		out = out[:maxKnownPeers]
	}
	return out, changed
}

// KnownPeers lists the addresses Heal contacts when they are not live
// members: configured join addresses (Name "" until matched) and peers
// seen, sorted by address.
func (m *Mesh) KnownPeers() []KnownPeer {
	h := &m.heal
	h.mu.Lock()
	out := make([]KnownPeer, 0, len(h.targets))
	for a, tg := range h.targets {
		out = append(out, KnownPeer{Name: tg.name, Addr: a, LastSeen: tg.lastSeen})
	}
	h.mu.Unlock()
	slices.SortFunc(out, func(a, b KnownPeer) int { return cmp.Compare(a.Addr, b.Addr) })
	return out
}

// newNetTransport binds memberlist's own UDP/TCP transport as memberlist
// would, for WrapTransport: a port of 0 picks a free one (retrying, as
// memberlist does, when TCP and UDP disagree) and becomes mc's port.
func newNetTransport(mc *memberlist.Config) (*memberlist.NetTransport, error) {
	nc := &memberlist.NetTransportConfig{BindAddrs: []string{mc.BindAddr}, BindPort: mc.BindPort, Logger: mc.Logger}
	tries := 1
	if mc.BindPort == 0 {
		tries = 10
	}
	var err error
	for range tries {
		var nt *memberlist.NetTransport
		if nt, err = memberlist.NewNetTransport(nc); err == nil {
			if mc.BindPort == 0 {
				mc.BindPort = nt.GetAutoBindPort()
				if mc.AdvertiseAddr == "" {
					mc.AdvertisePort = mc.BindPort
				}
			}
			return nt, nil
		}
	}
	return nil, fmt.Errorf("gossip transport: %w", err)
}
