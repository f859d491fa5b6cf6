package mesh

import (
	"crypto/ed25519"
	"errors"
	"fmt"

	"github.com/infermesh/infermesh/identity"
)

const (
	metaVersion = 1
	metaDomain  = "infermesh/node-meta/v1\x00"
	// maxClusterLen and maxQUICAddrLen bound the variable parts of node meta
	// so that it always fits memberlist's 512-byte limit.
	maxClusterLen  = 64
	maxQUICAddrLen = 64
	maxMetaLen     = 1 + 1 + maxClusterLen + ed25519.PublicKeySize + 1 + maxQUICAddrLen +
		1 + identity.MaxCertLen + 1 + 8*identity.MaxGossipKeys + ed25519.SignatureSize
)

// errBadMeta is wrapped by every node meta that cannot be parsed or whose
// self-signature does not verify.
var errBadMeta = errors.New("bad node meta")

// nodeMeta is what a node says about itself in memberlist: its identity key,
// its admission proof, where its QUIC endpoint is, and which gossip keys it
// holds. It is signed by the node's own key, binding it to the node name:
// this proves the holder of the key produced it (not that the sender is that
// holder; the gossip key alone proves membership only).
type nodeMeta struct {
	cluster  string
	key      ed25519.PublicKey
	quicAddr string
	cert     *identity.Certificate // nil: none (static trust)
	keyFPs   []identity.Fingerprint
}

func (m *nodeMeta) marshal(name string, priv ed25519.PrivateKey) ([]byte, error) {
	if len(m.cluster) > maxClusterLen {
		return nil, fmt.Errorf("cluster name longer than %d bytes", maxClusterLen)
	}
	if len(m.quicAddr) > maxQUICAddrLen {
		return nil, fmt.Errorf("QUIC address longer than %d bytes", maxQUICAddrLen)
	}
	if len(m.keyFPs) > identity.MaxGossipKeys {
		return nil, fmt.Errorf("more than %d gossip keys", identity.MaxGossipKeys)
	}
	b := make([]byte, 0, maxMetaLen)
	b = append(b, metaVersion, byte(len(m.cluster)))
	b = append(b, m.cluster...)
	b = append(b, m.key...)
	b = append(b, byte(len(m.quicAddr)))
	b = append(b, m.quicAddr...)
	if m.cert != nil {
		c := m.cert.Marshal()
		b = append(b, byte(len(c)))
		b = append(b, c...)
	} else {
		b = append(b, 0)
	}
	b = append(b, byte(len(m.keyFPs)))
	for _, fp := range m.keyFPs {
		b = append(b, fp[:]...)
	}
	sig := ed25519.Sign(priv, metaSigned(name, b))
	return append(b, sig...), nil
}

func metaSigned(name string, body []byte) []byte {
	msg := make([]byte, 0, len(metaDomain)+len(name)+1+len(body))
	msg = append(msg, metaDomain...)
	msg = append(msg, name...)
	msg = append(msg, 0)
	return append(msg, body...)
}

// parseMeta decodes the meta of node name and verifies its self-signature.
func parseMeta(name string, b []byte) (*nodeMeta, error) {
	if len(b) < ed25519.SignatureSize+1 {
		return nil, fmt.Errorf("%w: %d bytes", errBadMeta, len(b))
	}
	body, sig := b[:len(b)-ed25519.SignatureSize], b[len(b)-ed25519.SignatureSize:]
	r := reader{b: body}
	if v := r.byte(); v != metaVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", errBadMeta, v, metaVersion)
	}
	m := &nodeMeta{}
	m.cluster = string(r.bytes(int(r.byte())))
	m.key = ed25519.PublicKey(append([]byte(nil), r.bytes(ed25519.PublicKeySize)...))
	m.quicAddr = string(r.bytes(int(r.byte())))
	if n := int(r.byte()); n > 0 {
		raw := r.bytes(n)
		if r.err == nil {
			c, err := identity.UnmarshalCertificate(raw)
			if err != nil {
				return nil, fmt.Errorf("%w: %w", errBadMeta, err)
			}
			m.cert = c
		}
	}
	nfp := int(r.byte())
	for range nfp {
		var fp identity.Fingerprint
		copy(fp[:], r.bytes(8))
		m.keyFPs = append(m.keyFPs, fp)
	}
	if r.err != nil || len(r.b) != 0 {
		return nil, fmt.Errorf("%w: truncated or trailing bytes", errBadMeta)
	}
	if !ed25519.Verify(m.key, metaSigned(name, body), sig) {
		return nil, fmt.Errorf("%w: self-signature does not verify", errBadMeta)
	}
	return m, nil
}

// reader reads a length-checked binary layout; after the first short read
// every read returns zero values and err is set.
type reader struct {
	b   []byte
	err error
}

func (r *reader) bytes(n int) []byte {
	if r.err != nil || n > len(r.b) {
		r.err = errors.New("short")
		return make([]byte, n)
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) byte() byte { return r.bytes(1)[0] }
