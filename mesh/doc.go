// Package mesh is how infermesh agents find, admit and reach one another:
// gossip membership with admission, signed role adverts, and the QUIC
// transport that carries requests between agents. It decides who may talk
// to this node, and says who serves what; it does not decide which roles go
// to whom (package placement, fed by the adverts) and does not forward
// requests itself (package proxy sends and serves them through Transport).
// Node keys, admission certificates and gossip keys are package identity's.
//
// # Membership (Mesh)
//
// A Mesh is this node's membership over hashicorp/memberlist (Config.BindAddr,
// UDP and TCP), encrypted with the cluster's gossip keyring (AES-256;
// rotated live with InstallKey, UseKey and RemoveKey, persisted to the
// keyring file). Every node publishes node meta signed by its own node key:
// its public key, its admission certificate if it has one, its QUIC address
// and the fingerprints of the gossip keys it holds (ListKeys counts them).
// An alive delegate refuses, before memberlist lists it, a node that is not
// admitted, belongs to another cluster, or claims a name or key a live node
// already has. Join retries with backoff; ErrJoinRefused is permanent.
//
// # Healing
//
// memberlist gossips and push/pulls only with members it believes alive,
// so two sides that declared each other dead, or a restarted node given no
// join address, stay apart. Heal keeps the mesh whole, like Consul's
// retry_join and serf's reconnect: it contacts every configured join
// address and every peer seen (a PeerBook keeps them across restarts)
// that is not a live member, each on its own doubling backoff
// (RejoinInterval to RejoinMaxBackoff), and forgets a peer not seen for
// ReconnectTimeout. JoinNow contacts addresses at once and keeps them.
//
// # Confirmed deaths
//
// Any holder of the gossip key can tell memberlist that a peer is dead.
// With a Confirmer (SetConfirmer: the Transport), gossip saying a peer left
// or died is checked over QUIC, where the peer's key is pinned, before its
// adverts are forgotten: a peer that answers and is not leaving (Leave makes
// the probe say so) keeps them, the false death is audited
// (AuditPeerDeathRefuted) and counted (false_death), and the peer is asked
// again every ConfirmInterval while gossip keeps calling it gone.
//
// # Admission
//
// A node is admitted when the trust configuration (TrustConfig) vouches for
// its (name, key): a static entry, which pins the key for that name, or an
// admission certificate signed by a cluster authority and not expired.
// Revocation, by name or key, from the configuration, at run time
// (Revoke) or by a signed statement (below), takes effect at once: IsAdmitted and MayServe re-check on every
// call, which is how a Mesh serves as placement's Admission, and SetTrust
// swaps the configuration on reload. Refusals are counted (Refusals) and
// audited (AuditNodeRefused, AuditAdvertRefused; rate-limited).
//
// # Signed revocations
//
// A run-time revocation is this node's alone, and a peer's word that a
// node is revoked is worth nothing (any full-scope node could then cut any
// other out). A statement signed by an authority (identity.Revocation) is
// evidence: AcceptRevocation takes it from anyone (the admin socket,
// gossip, a peer over QUIC) when one of the Authorities signed it and it
// is newer than the one held about its subject, and its subject is then
// refused as by Revoke. It spreads as a gossip broadcast and in every
// push/pull (joins included), and SpreadRevocation sends it to every
// admitted live peer over QUIC. The newest statement about each subject is
// kept, liftings too, so an older one replayed later changes nothing; a
// RevocationSink persists them (the agent's state store) and
// LoadRevocations brings them back at start.
//
// # Keyrings
//
// The gossip keyring (AES-256) is changed by this node's operator
// (InstallKey, UseKey, RemoveKey, RetainKeys), and over QUIC by a peer that
// MayChangeKeyring allows: vouched for now with full scope and the key it
// presented, and covered by no revocation this node knows of (configured,
// run-time or signed). Every change a peer sends names its reason and its
// rotation and is reported to TransportConfig.OnKeyring, applied or
// refused. RotateGossipKey makes a new key the only one on every admitted
// live peer (a revoked node never gets it); ReturnKeyring gives a node
// whose revocation was lifted this node's keyring, reaching it at the
// address it last gossiped when gossip lost it.
//
// # Adverts
//
// An advert says that its origin serves infer.<role> (or withdraws it),
// with the model, runtime and load. This node's adverts are its exposed
// local roles, read from the AdvertSink (the placement table), each signed
// by the node key with a sequence number that keeps rising across restarts.
// They travel as memberlist broadcasts and, whole, in push/pull exchanges.
// A received advert reaches the sink only when it is signed by its origin's
// key, the origin is admitted with ScopeFull, and its sequence is above the
// highest seen from that origin (kept for a while after the origin left, so
// an old advert cannot bring a withdrawn role back); placement then applies
// this node's allowlist. Freshness counts from when this node received a
// new sequence, never from the origin's clock.
//
// # The QUIC transport (Transport)
//
// Agent-to-agent HTTP/3 over QUIC on one UDP socket (mesh.quic in the
// agent's config): RoundTrip dials peers (the proxy's remote candidates, one
// connection per peer, reused) and Serve answers them (the proxy's peer
// handler). Both sides present a self-signed certificate of their node key
// (NodeCertificate) and pin the other's key to an admitted node through a
// PeerDirectory: the Mesh, or a StaticDirectory where there is no gossip
// (benchmarks, tools). The node a connection was verified as is the only
// identity the serving side trusts (PeerFromRequest). The dialing side
// pins a live admitted member's key; the serving side asks only whether the
// client's (name, key) is vouched for (TrustsKey, on the node meta it last
// gossiped), so a restarted peer is served while gossip here still records
// its leave. Live connections are re-checked against the directory:
// revocation or a changed key cuts them; gossip alone saying a peer is
// gone does not.
//
// An admitted peer is bounded per authenticated node, across all of its
// connections, in the transport's own code around the connection, the
// handler and the response (see peerlimits.go): its connections
// (MaxConnsPerPeer), its requests in flight (MaxStreamsPerPeer), the time
// its request bodies take (BodyTimeout), and the response head it may send
// back (MaxHeadBytes).
//
// # Words
//
//   - node: a host running an agent, named by its node name; a peer is any
//     other node, a member one memberlist lists right now.
//   - admitted: vouched for by the trust configuration right now, and not
//     revoked. Scope: full (may consume and serve) or consumer (may only
//     consume: its adverts are never heard).
//   - origin: the node an advert is about, and the only key that may sign it.
//   - node meta: what a node says about itself in memberlist, self-signed.
//   - gossip key: shared by every member, so it proves membership of the
//     gossip, never a node's identity: that is why node meta and adverts are
//     signed by node keys, and why only the QUIC transport's pinned keys
//     decide whether a connection stays open.
//   - statement: a revocation, or the lifting of one, signed by an
//     authority, about a subject (a node name or a node key), ordered
//     among the statements about that subject by its serial.
//   - refusal: anything turned away, with a stable reason (the keys of
//     Refusals and Transport.Refusals, fit for metrics).
package mesh
