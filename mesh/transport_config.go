package mesh

import (
	"crypto/ed25519"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/defaults"
)

// PeerDirectory is where the transport learns which peers exist: where to
// dial them, which key to pin, and whether they are admitted right now.
// *Mesh satisfies it.
//
// Methods must be safe for concurrent use and must not block: they are
// called on every request, in TLS handshakes and from the re-check loop.
// PeerAddr and PeerKey answer only for nodes admitted right now, so one
// PeerKey call is an admission check and the key to pin at once (the
// per-request check).
type PeerDirectory interface {
	// PeerAddr is the QUIC address (host:port) an admitted peer advertised;
	// false when the node is not admitted.
	PeerAddr(node string) (string, bool)
	// PeerKey is the identity key an admitted peer is pinned to; false
	// when the node is not admitted.
	PeerKey(node string) (ed25519.PublicKey, bool)
	// IsAdmitted reports whether node is admitted right now.
	IsAdmitted(node string) bool
	// TrustsKey reports whether node with key is vouched for (not
	// revoked, key unchanged), whether or not it is a live member now. It
	// decides whether a peer's handshake is accepted and whether an
	// established connection stays open.
	TrustsKey(node string, key ed25519.PublicKey) bool
}

var _ PeerDirectory = (*Mesh)(nil)

// Transport defaults.
const (
	DefaultHandshakeTimeout  = 2 * time.Second
	DefaultKeepAlivePeriod   = 2 * time.Second
	DefaultMaxIdleTimeout    = 6 * time.Second
	DefaultRecheckInterval   = time.Second
	DefaultMaxStreamsPerPeer = 4096
	DefaultMaxConnsPerPeer   = 4
	DefaultBodyTimeout       = 60 * time.Second
)

// TransportConfig configures a Transport. The zero value of a field means its
// default (see DefaultTransportConfig); Name, Key, Peers and one of Listen or
// PacketConn are required.
type TransportConfig struct {
	// Name is this node's name; it is the common name of our certificate.
	Name string
	// Key is this node's identity key; our self-signed certificate is of it.
	Key ed25519.PrivateKey
	// Listen is the UDP address to bind, host:port (port 0 picks one; see
	// Addr). Ignored when PacketConn is set.
	Listen string
	// PacketConn, when set, is used instead of binding Listen. The caller
	// owns it: Close does not close it.
	PacketConn net.PacketConn
	// Peers tells who is admitted, where to dial them and which key to pin.
	Peers PeerDirectory
	// Handler serves requests from peers. Each request's context carries the
	// node the connection was verified as (PeerFromRequest). Nil: every peer
	// request gets 404.
	Handler http.Handler
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
	// HandshakeTimeout bounds dialing a peer: the QUIC and TLS handshake.
	// It is the per-attempt connect timeout of a remote request that needs a
	// new connection. Default DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// KeepAlivePeriod is how often an otherwise idle connection is pinged,
	// so a live peer's connection stays open and a dead one is noticed.
	// Default DefaultKeepAlivePeriod.
	KeepAlivePeriod time.Duration
	// MaxIdleTimeout closes a connection that received nothing for this
	// long: with keep-alives, how long a peer that vanished without a word
	// (killed, unplugged) can stall a stream. Default DefaultMaxIdleTimeout.
	MaxIdleTimeout time.Duration
	// RecheckInterval is how often live connections are checked against the
	// directory: a connection whose peer is no longer admitted, changed its
	// key, or (ours) moved address is closed, aborting its streams.
	// Default DefaultRecheckInterval.
	RecheckInterval time.Duration
	// MaxStreamsPerPeer bounds the requests a peer may have in flight here
	// at once, across all of its connections; each connection also allows
	// at most that many streams, so a peer with one connection (an agent
	// keeps one) waits for a free stream rather than being refused.
	// Default DefaultMaxStreamsPerPeer.
	MaxStreamsPerPeer int64
	// MaxConnsPerPeer bounds the QUIC connections one peer (node) may hold
	// here at once; another is closed after its handshake. An agent keeps
	// one; a restarted one may leave the old one open until it times out.
	// Default DefaultMaxConnsPerPeer.
	MaxConnsPerPeer int
	// BodyTimeout bounds reading a peer's request body, from the start of
	// the request (the stream's read deadline): a body that has not
	// arrived by then is answered 408 and the stream closed. Default
	// DefaultBodyTimeout.
	BodyTimeout time.Duration
	// OnRefused is told about refused peers: handshakes (either side) and
	// requests from a peer no longer admitted. peer is the node claimed, or
	// "addr:<ip>" when none was. Called at most once per (peer, why)
	// every 10s; Refusals counts every one. Must not block.
	OnRefused func(peer, why string)
	// Leaving reports whether this node is leaving the mesh: the liveness
	// probe (Transport.ConfirmAlive, from peers) then answers so, and peers
	// forget this node at once. Nil: never leaving. Usually Mesh.Leaving.
	Leaving func() bool
	// Info answers admitted peers' info calls (Transport.Info): this
	// node's version and its roles' load now. Must be quick and not
	// block. Nil: the call is answered 404.
	Info func() NodeInfo
	// Keyring applies keyring changes that peers send (Mesh.RotateGossipKey
	// on another node) and decides whose it applies (MayChangeKeyring).
	// Nil: none are taken. Usually the Mesh.
	Keyring KeyringChanger
	// OnKeyring is told of every keyring change a peer sent here, applied
	// or refused (refusals at most once per sender and operation every
	// 10s). Must not block. Nil: none.
	OnKeyring func(KeyringEvent)
}

// DefaultTransportConfig returns the defaults (without identity, address or
// directory).
func DefaultTransportConfig() TransportConfig {
	return TransportConfig{
		HandshakeTimeout:  DefaultHandshakeTimeout,
		KeepAlivePeriod:   DefaultKeepAlivePeriod,
		MaxIdleTimeout:    DefaultMaxIdleTimeout,
		RecheckInterval:   DefaultRecheckInterval,
		MaxStreamsPerPeer: DefaultMaxStreamsPerPeer,
		MaxConnsPerPeer:   DefaultMaxConnsPerPeer,
		BodyTimeout:       DefaultBodyTimeout,
	}
}

func (c TransportConfig) withDefaults() (TransportConfig, error) {
	d := DefaultTransportConfig()
	if err := nonNegative(
		namedDuration{"HandshakeTimeout", c.HandshakeTimeout}, namedDuration{"KeepAlivePeriod", c.KeepAlivePeriod},
		namedDuration{"MaxIdleTimeout", c.MaxIdleTimeout}, namedDuration{"RecheckInterval", c.RecheckInterval},
		namedDuration{"BodyTimeout", c.BodyTimeout},
	); err != nil {
		return c, err
	}
	if c.MaxStreamsPerPeer < 0 {
		return c, errors.New("MaxStreamsPerPeer: negative")
	}
	if c.MaxConnsPerPeer < 0 {
		return c, errors.New("MaxConnsPerPeer: negative")
	}
	defaults.Zero(&c.HandshakeTimeout, d.HandshakeTimeout)
	defaults.Zero(&c.KeepAlivePeriod, d.KeepAlivePeriod)
	defaults.Zero(&c.MaxIdleTimeout, d.MaxIdleTimeout)
	defaults.Zero(&c.RecheckInterval, d.RecheckInterval)
	defaults.Zero(&c.MaxStreamsPerPeer, d.MaxStreamsPerPeer)
	defaults.Zero(&c.MaxConnsPerPeer, d.MaxConnsPerPeer)
	defaults.Zero(&c.BodyTimeout, d.BodyTimeout)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if err := identity.ValidateNodeName(c.Name); err != nil {
		return c, fmt.Errorf("Name: %w", err)
	}
	if len(c.Key) != ed25519.PrivateKeySize {
		return c, fmt.Errorf("Key: %d bytes, want an ed25519 private key", len(c.Key))
	}
	if c.Peers == nil {
		return c, errors.New("Peers: required")
	}
	if c.PacketConn == nil {
		if c.Listen == "" {
			return c, errors.New("Listen: required (or PacketConn)")
		}
		if _, _, err := splitHostPort(c.Listen); err != nil {
			return c, fmt.Errorf("Listen: %w", err)
		}
	}
	if c.KeepAlivePeriod >= c.MaxIdleTimeout {
		return c, fmt.Errorf("KeepAlivePeriod: %v is not shorter than MaxIdleTimeout %v", c.KeepAlivePeriod, c.MaxIdleTimeout)
	}
	return c, nil
}
