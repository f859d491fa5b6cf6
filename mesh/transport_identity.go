package mesh

import "crypto/ed25519"

// NodeKey is this node's private identity key, for the QUIC transport's
// certificate (TransportConfig.Key). Never log or send it.
func (m *Mesh) NodeKey() ed25519.PrivateKey { return m.priv }
