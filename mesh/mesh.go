package mesh

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/placement"
)

// Errors callers act on.
var (
	// ErrJoinRefused is wrapped by Join when a member refused us for a
	// reason retrying cannot fix (name or key conflict, other cluster).
	ErrJoinRefused = errors.New("join refused")
	// ErrClosed is returned by operations on a closed Mesh.
	ErrClosed = errors.New("mesh closed")
)

// Mesh is this node's membership. It satisfies placement.Admission. All
// methods are safe for concurrent use.
type Mesh struct {
	cfg  Config
	log  *zap.Logger
	name string
	priv ed25519.PrivateKey
	pub  ed25519.PublicKey
	cert *identity.Certificate // our admission certificate, nil when none
	sink AdvertSink

	ml      *memberlist.Memberlist
	keyring *memberlist.Keyring
	bcast   *memberlist.TransmitLimitedQueue
	meta    atomic.Pointer[[]byte] // our node meta, rebuilt on keyring change
	seq     atomic.Uint64          // last advert sequence number we used
	members atomic.Int64           // live peers + 1, for the broadcast queue

	selfAddrCache atomic.Pointer[string] // our gossip address, set once memberlist bound

	// advMu orders everything that reaches the sink for an origin: advert
	// ingest, withdrawals, leave and revocation. Lock order: advMu, then mu.
	advMu   sync.Mutex
	adverts map[advertKey]*advertRecord
	origins map[string]*originState // by origin key bytes: sequence and advert set high-water marks

	seqDirty    atomic.Bool // origins changed since saved
	seqReserved uint64      // our sequence floor as saved; Heal's goroutine only

	// mu guards trust and the peer table.
	mu    sync.RWMutex
	trust *trustState
	peers map[string]*peer
	// peerKeys indexes peers by public key (key bytes to the names
	// holding it), for the key-conflict check every alive message and
	// push/pull entry goes through.
	peerKeys map[string][]string
	// departed holds the last record of peers that left or were declared
	// dead, so connections verified before can be re-checked against trust
	// (revocation, key change) without equating "not a live member" with
	// "no longer trusted". Bounded by the nodes ever seen.
	departed map[string]*peer
	removed  map[string]bool // peers whose adverts we dropped because they are no longer admitted
	// revs is the newest statement signed by an authority held about each
	// subject, revoking or lifting (revocations.go); trust.signed is the
	// revoking ones.
	revs   map[revocation]*heldRevocation
	revOut revocationOutbox // accepted statements, for the RevocationSink
	// gossipLive is memberlist's own view of the live peers (alive or
	// suspect), name to gossip address, copied in its event callbacks:
	// memberlist.Members' nodes are shared with its state goroutines and
	// may not be read outside them.
	gossipLive map[string]string
	liveXor    uint64       // xor of nameHash over gossipLive's names (see liveDigest)
	liveEvents atomic.Int64 // changes of gossipLive's name set so far
	aeWant     chan string  // a digest differed: push/pull with this sender (antiEntropyLoop)

	early early // adverts that came before their origin's alive message
	// back names peers gossip saw alive again (first join, refuted
	// death, thawed): the advertise loop re-advertises and sends them
	// what it holds.
	back chan string
	// refuted hears that memberlist refuted a suspicion or death of this
	// node (zapWriter): members that declared us dead forgot our adverts,
	// so the advertise loop re-advertises.
	refuted  chan struct{}
	lastBack time.Time // the last re-advertisement (readvertise); the loop's own
	// readvertiseDue: a re-advertisement is asked for and waits for the
	// once-a-second bound; the loop's own.
	readvertiseDue bool
	// lastPiggybacks is stats.advertPiggybacks when the advertise loop
	// last looked (gossipStarvedAdverts); the loop's own.
	lastPiggybacks uint64

	metaCache    metaCache
	refusals     refusals
	refusedNodes refusedNodes // nodes refused membership, for peers and unrevoke
	stats        gossipStats
	rtt          rttBook // round-trip times memberlist's probes measured (rtt.go)

	// joinRefusal is set by the merge delegate when it refuses a join for a
	// permanent reason; Join reads it.
	joinRefusal atomic.Pointer[error]
	// merged is set once a push/pull's state (its adverts) has been merged,
	// whichever side began it: until then, a peer that gossip already lists
	// as live may not have given us what it serves (see Heal's first round).
	merged atomic.Bool

	keyringMu sync.Mutex // serializes keyring changes and their file writes

	heal healer // Heal's rejoin targets

	confirmer atomic.Pointer[Confirmer] // confirms gossip deaths over QUIC; nil: gossip decides
	leaving   atomic.Bool               // Leave was called

	// spawnMu orders spawn's wg.Add before Close's wg.Wait.
	spawnMu     sync.Mutex
	spawnClosed bool

	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
}

var _ placement.Admission = (*Mesh)(nil)

// peer is a live member that passed the alive delegate.
type peer struct {
	name   string
	addr   string // gossip address
	meta   *nodeMeta
	certOK bool // meta.cert verified against the current authorities
}

// New loads (or creates) the node key, loads the keyring, starts memberlist
// listening on BindAddr and starts advertising. It does not join: call Join.
// Close releases everything.
func New(cfg Config) (*Mesh, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("mesh config: %w", err)
	}
	priv, created, err := identity.LoadOrCreateKey(cfg.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("node key: %w", err)
	}
	m := &Mesh{
		cfg:      cfg,
		log:      cfg.Logger.With(zap.String("node", cfg.NodeName)),
		name:     cfg.NodeName,
		priv:     priv,
		pub:      priv.Public().(ed25519.PublicKey),
		sink:     cfg.Sink,
		adverts:  map[advertKey]*advertRecord{},
		peers:    map[string]*peer{},
		peerKeys: map[string][]string{},
		departed: map[string]*peer{},
		removed:  map[string]bool{},
		revs:     map[revocation]*heldRevocation{},
		revOut:   revocationOutbox{wake: make(chan struct{}, 1)},

		gossipLive: map[string]string{},
		back:       make(chan string, 64),
		refuted:    make(chan struct{}, 1),
		aeWant:     make(chan string, 1),
	}
	m.heal.targets = map[string]*rejoinTarget{}
	m.origins = map[string]*originState{}
	if created {
		m.log.Info("created node key", zap.String("path", cfg.KeyFile), zap.String("public_key", identity.EncodeNodeKey(m.pub)))
	}
	m.refusals.init()
	m.metaCache.init()
	if m.trust, err = newTrustState(cfg.Trust, nil); err != nil {
		return nil, fmt.Errorf("mesh config: %w", err)
	}
	if cfg.Certificate != "" {
		c, err := identity.ParseCertificate(cfg.Certificate)
		if err != nil {
			return nil, fmt.Errorf("mesh config: Certificate: %w", err)
		}
		if c.Name != m.name || !c.PublicKey.Equal(m.pub) {
			return nil, fmt.Errorf("mesh config: Certificate: issued to %q with key %s, not to this node (%q, %s)",
				c.Name, identity.EncodeNodeKey(c.PublicKey), m.name, identity.EncodeNodeKey(m.pub))
		}
		if !cfg.Now().Before(c.Expires) {
			m.log.Error("this node's admission certificate has EXPIRED: peers will refuse it", zap.Time("expired", c.Expires))
		}
		m.cert = c
	}
	keys, err := identity.LoadKeyring(cfg.KeyringPath)
	if err != nil {
		return nil, fmt.Errorf("mesh: %w (create one with `infermesh keygen --gossip --keyring FILE`)", err)
	}
	if m.keyring, err = memberlist.NewKeyring(keys, keys[0]); err != nil {
		return nil, fmt.Errorf("mesh: gossip keyring: %w", err)
	}
	if err := m.rebuildMeta(); err != nil {
		return nil, fmt.Errorf("mesh: node meta: %w", err)
	}
	// The newest sequence number must exceed any we used before a restart,
	// without trusting anyone else's clock: start from our wall clock.
	m.seq.Store(uint64(time.Now().UnixNano()))
	m.members.Store(1)
	m.bcast = &memberlist.TransmitLimitedQueue{
		NumNodes:       func() int { return int(m.members.Load()) },
		RetransmitMult: cfg.RetransmitMult,
	}

	mc, err := m.memberlistConfig()
	if err != nil {
		return nil, fmt.Errorf("mesh config: %w", err)
	}
	if cfg.Admission != nil {
		cfg.Admission.Bind(m)
	}
	if m.ml, err = memberlist.Create(mc); err != nil {
		if cfg.Admission != nil {
			cfg.Admission.Bind(nil)
		}
		return nil, fmt.Errorf("mesh: start memberlist: %w", err)
	}
	self := m.ml.LocalNode().Address()
	m.selfAddrCache.Store(&self)
	m.ctx, m.cancel = context.WithCancel(context.Background())
	m.wg.Add(3)
	go m.advertiseLoop()
	go m.antiEntropyLoop()
	go m.revocationLoop()
	m.log.Info("mesh started", zap.String("gossip", m.GossipAddr()), zap.String("cluster", cfg.Cluster),
		zap.String("public_key", identity.EncodeNodeKey(m.pub)))
	return m, nil
}

func (m *Mesh) memberlistConfig() (*memberlist.Config, error) {
	c := m.cfg
	mc := memberlist.DefaultLANConfig()
	mc.Name = m.name
	host, port, _ := splitHostPort(c.BindAddr)
	mc.BindAddr, mc.BindPort = host, port
	mc.AdvertisePort = port
	if c.AdvertiseAddr != "" {
		host, port, _ := splitHostPort(c.AdvertiseAddr)
		mc.AdvertiseAddr, mc.AdvertisePort = host, port
	}
	mc.Label = c.Cluster
	mc.Keyring = m.keyring
	mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	// Node meta is keys, signatures and a certificate, adverts are signed:
	// LZW saves little on them and, with its per-packet tables, was a
	// fifth of the CPU of a forming 100-node mesh (and much of its GC).
	mc.EnableCompression = false
	mc.GossipInterval = c.GossipInterval
	mc.GossipNodes = c.GossipNodes
	mc.ProbeInterval = c.ProbeInterval
	mc.ProbeTimeout = c.ProbeTimeout
	mc.PushPullInterval = c.PushPullInterval
	mc.SuspicionMult = c.SuspicionMult
	mc.RetransmitMult = c.RetransmitMult
	mc.TCPTimeout = c.TCPTimeout
	mc.Transport = c.Transport
	mc.Delegate = (*delegate)(m)
	mc.Events = (*events)(m)
	mc.Alive = (*aliveDelegate)(m)
	mc.Merge = (*mergeDelegate)(m)
	mc.Conflict = (*conflictDelegate)(m)
	mc.Ping = (*pingDelegate)(m)
	mc.Logger = log.New(zapWriter{l: m.log.Named("memberlist"), refuted: m.noteRefuted}, "", 0)
	if c.WrapTransport != nil {
		nt, err := newNetTransport(mc)
		if err != nil {
			return nil, err
		}
		mc.Transport = c.WrapTransport(nt)
	}
	return mc, nil
}

// Name is this node's name.
func (m *Mesh) Name() string { return m.name }

// PublicKey is this node's identity key.
func (m *Mesh) PublicKey() ed25519.PublicKey { return m.pub }

// NodeKey is this node's private identity key, for the QUIC transport's
// certificate (TransportConfig.Key). Never log or send it.
func (m *Mesh) NodeKey() ed25519.PrivateKey { return m.priv }

// GossipAddr is the gossip address other nodes join, host:port (with the
// port memberlist actually bound when BindAddr had port 0).
func (m *Mesh) GossipAddr() string {
	n := m.ml.LocalNode()
	return n.Address()
}

// Join contacts the configured Join addresses until one accepts, retrying
// with a doubling backoff (JoinBackoff up to JoinMaxBackoff). It returns
// how many contacts succeeded; an empty Join list returns 0, nil at once. It
// stops with an error when ctx ends, the Mesh closes, or a member refuses us
// for a permanent reason (the error wraps ErrJoinRefused).
func (m *Mesh) Join(ctx context.Context) (int, error) {
	return m.JoinAddrs(ctx, m.cfg.Join)
}

// JoinAddrs is Join with an explicit address list.
func (m *Mesh) JoinAddrs(ctx context.Context, addrs []string) (int, error) {
	if len(addrs) == 0 {
		return 0, nil
	}
	backoff := m.cfg.JoinBackoff
	for attempt := 1; ; attempt++ {
		m.joinRefusal.Store(nil)
		n, err := m.ml.Join(addrs)
		if n > 0 {
			m.log.Info("joined the mesh", zap.Int("contacts", n), zap.Int("members", m.ml.NumMembers()))
			return n, nil
		}
		if p := m.joinRefusal.Load(); p != nil {
			return 0, fmt.Errorf("%w: %w", ErrJoinRefused, *p)
		}
		m.log.Warn("join failed; retrying", zap.Int("attempt", attempt), zap.Duration("backoff", backoff), zap.Error(err))
		// Jitter keeps a restarted fleet from retrying in lockstep.
		wait := backoff + rand.N(backoff/4+1)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("join %v: %w (last error: %v)", addrs, ctx.Err(), err)
		case <-m.ctx.Done():
			t.Stop()
			return 0, ErrClosed
		case <-t.C:
		}
		backoff = min(backoff*2, m.cfg.JoinMaxBackoff)
	}
}

// Leave tells the other members we are leaving (they forget our adverts at
// once) and waits up to timeout for the message to spread. Call Close after.
func (m *Mesh) Leave(timeout time.Duration) error {
	m.leaving.Store(true)
	if err := m.ml.Leave(timeout); err != nil {
		return fmt.Errorf("leave: %w", err)
	}
	return nil
}

// Close stops advertising and shuts memberlist down without a leave message
// (peers will declare us dead). It is idempotent.
func (m *Mesh) Close() error {
	m.closeOnce.Do(func() {
		m.spawnMu.Lock()
		m.spawnClosed = true
		m.spawnMu.Unlock()
		m.cancel()
		if err := m.ml.Shutdown(); err != nil {
			m.closeErr = fmt.Errorf("memberlist shutdown: %w", err)
		}
		m.wg.Wait()
	})
	return m.closeErr
}

// PeerInfo is one member as Members reports it.
type PeerInfo struct {
	Name       string
	GossipAddr string
	QUICAddr   string
	PublicKey  ed25519.PublicKey
	Scope      identity.Scope // 0 when not admitted
	Admitted   bool           // admitted right now
	Why        string         // why not admitted
	Self       bool
	// CertExpires is when the node's admission certificate expires; zero
	// when it gossips none.
	CertExpires time.Time
	// RTT is the smoothed round-trip time of memberlist's direct probes of
	// the node, and Heard when the last one was answered; zero for this
	// node and before the first answer.
	RTT   time.Duration
	Heard time.Time
}

func certExpires(c *identity.Certificate) time.Time {
	if c == nil {
		return time.Time{}
	}
	return c.Expires
}

// Members lists this node and every live peer that passed admission when
// it joined, with its admission now; sorted by name.
func (m *Mesh) Members() []PeerInfo {
	now := m.cfg.Now()
	m.mu.RLock()
	out := make([]PeerInfo, 0, len(m.peers)+1)
	for _, p := range m.peers {
		s, why := m.trust.admit(p.name, p.meta.key, p.meta.cert, p.certOK, now)
		rtt, heard := m.rtt.get(p.name)
		out = append(out, PeerInfo{
			Name: p.name, GossipAddr: p.addr, QUICAddr: p.meta.quicAddr, PublicKey: p.meta.key,
			Scope: s, Admitted: s != 0, Why: why, CertExpires: certExpires(p.meta.cert),
			RTT: rtt, Heard: heard,
		})
	}
	m.mu.RUnlock()
	out = append(out, PeerInfo{
		Name: m.name, GossipAddr: m.GossipAddr(), QUICAddr: m.cfg.QUICAddr, PublicKey: m.pub,
		Scope: m.selfScope(), Admitted: true, Self: true, CertExpires: certExpires(m.cert),
	})
	slices.SortFunc(out, func(a, b PeerInfo) int {
		switch {
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return out
}

// Refusals returns how many times each kind of refusal happened, keyed by
// reason (e.g. "bad_signature", "stale_sequence", "not_allowlisted").
func (m *Mesh) Refusals() map[string]uint64 { return m.refusals.snapshot() }

func (m *Mesh) rebuildMeta() error {
	nm := &nodeMeta{cluster: m.cfg.Cluster, key: m.pub, quicAddr: m.cfg.QUICAddr, cert: m.cert}
	for _, k := range m.keyring.GetKeys() {
		nm.keyFPs = append(nm.keyFPs, identity.GossipKeyFingerprint(k))
	}
	b, err := nm.marshal(m.name, m.priv)
	if err != nil {
		return err
	}
	if len(b) > memberlist.MetaMaxSize {
		return fmt.Errorf("%d bytes, more than memberlist's %d", len(b), memberlist.MetaMaxSize)
	}
	m.meta.Store(&b)
	return nil
}

// zapWriter turns memberlist's log lines into zap entries. memberlist warns
// about every refused alive message; our own audit covers those, so its
// WARN lines are logged at info.
//
// Its line about refuting a suspicion or death of this node is also the
// only sign memberlist gives of one (no delegate is called): refuted is
// called, and must not block (memberlist logs it with its node lock held).
type zapWriter struct {
	l       *zap.Logger
	refuted func() // nil: not told
}

// refutingPrefix starts memberlist's log line when it refutes an alive,
// suspect or dead message about this node (memberlist v0.7.0, state.go:
// refute's callers; TestRefuterReadvertises fails if it changes).
const refutingPrefix = "[WARN] memberlist: Refuting "

func (w zapWriter) Write(p []byte) (int, error) {
	s := string(p)
	for len(s) > 0 && (s[len(s)-1] == '\n' || s[len(s)-1] == ' ') {
		s = s[:len(s)-1]
	}
	if w.refuted != nil && strings.HasPrefix(s, refutingPrefix) {
		w.refuted()
	}
	switch {
	case len(s) > 5 && s[:5] == "[ERR]":
		w.l.Warn(s[6:])
	case len(s) > 6 && s[:6] == "[WARN]":
		w.l.Info(s[7:])
	default:
		w.l.Debug(s)
	}
	return len(p), nil
}
