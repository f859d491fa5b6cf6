// Package identity is who a node is in infermesh, and the files that say so.
// It has no network code: the CLI's offline key tools use it without
// linking the mesh, and the mesh builds admission and its transports on it.
//
// It owns:
//
//   - the node key: an ed25519 key in the state dir (NodeKeyFile, mode 0600,
//     written atomically, never replaced silently; ErrKeyFile for a bad one),
//     its text forms (EncodeKey, ParsePublicKey) and node names
//     (ValidateNodeName);
//   - admission certificates: the cluster authority's signature over a
//     node's (name, public key, scope, expiry) (IssueCertificate,
//     ParseCertificate, VerifyCertificate). Scope says what an admitted node
//     may do: ScopeFull consumes and serves, ScopeConsumer only consumes;
//   - revocation statements: the authority's signature that a node name
//     or key is revoked, or no longer revoked, as of a serial
//     (IssueRevocation, ParseRevocation, VerifyRevocation); of two
//     statements about one subject the newer holds (Revocation.Newer);
//   - the gossip keyring: the AES-256 keys every member shares to encrypt
//     memberlist traffic, the keyring file (LoadKeyring, SaveKeyring,
//     WriteNewKeyring), and each key's Fingerprint, the one name a key goes
//     by in node meta, the admin API, the CLI and the audit log.
//
// It does not decide admission (which nodes a configuration trusts, and
// revocation): that is the mesh's trust state, which checks these
// certificates and statements. Nor does it hold the TLS certificate a node presents on the
// QUIC transport: the mesh derives that from the node key.
//
// Words: a node is a host in the mesh, named by its node name and proved by
// its node key. The authority is the key that signs admission certificates
// (trust.authority in the config), and revocation statements. A gossip
// key proves membership of the gossip only, never a node's identity.
package identity
