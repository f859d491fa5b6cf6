package mesh

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// Reaching a trusted peer that is not a live member. The pushes of keyring
// changes and signed revocations go to peers gossip may have lost: a node
// whose revocation was just lifted cannot read the mesh's gossip (the key
// rotated while it was revoked), so this node's memberlist declared it
// dead, and PeerKey no longer answers for it. Its key is still known and
// trusted (TrustsKey), and so is the QUIC address it last gossiped: such
// a push goes over a connection of its own to that address, pinned to that
// key, and closed after it.

// knownDirectory is the part of a PeerDirectory that knows trusted peers
// beyond the live members (the Mesh).
type knownDirectory interface {
	TrustedPeer(node string) (quicAddr string, key ed25519.PublicKey, ok bool)
}

var _ knownDirectory = (*Mesh)(nil)

// TrustedPeer returns the QUIC address and key node last gossiped, live
// member or departed, when it is vouched for now with that key (TrustsKey).
func (m *Mesh) TrustedPeer(node string) (string, ed25519.PublicKey, bool) {
	m.mu.RLock()
	p := m.peers[node]
	if p == nil {
		p = m.departed[node]
	}
	var meta *nodeMeta
	if p != nil {
		meta = p.meta
	}
	m.mu.RUnlock()
	if meta == nil || meta.quicAddr == "" || !m.TrustsKey(node, meta.key) {
		return "", nil, false
	}
	return meta.quicAddr, meta.key, true
}

// postTrusted POSTs body to path on node and returns the answer's status
// and (the start of) its body: over the shared connection when node is an
// admitted live member, else over a connection of its own to the address
// it last gossiped (TrustedPeer).
func (t *Transport) postTrusted(ctx context.Context, node, path, contentType string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+node+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", contentType)
	var resp *http.Response
	if _, live := t.dir.PeerKey(node); live {
		resp, err = t.RoundTrip(req)
	} else {
		resp, err = t.roundTripKnown(req, node)
	}
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, bytes.TrimSpace(msg), nil
}

// roundTripKnown sends req to a trusted peer that is not a live member,
// over a connection of its own, closed once the answer is read (the
// answer's body closes it).
func (t *Transport) roundTripKnown(req *http.Request, node string) (*http.Response, error) {
	kd, ok := t.dir.(knownDirectory)
	if !ok {
		return nil, fmt.Errorf("peer %q: %w", node, ErrUnknownPeer)
	}
	addr, key, ok := kd.TrustedPeer(node)
	if !ok {
		return nil, fmt.Errorf("peer %q: %w", node, ErrUnknownPeer)
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return nil, ErrTransportClosed
	}
	ctx, cancel := context.WithTimeout(req.Context(), t.cfg.HandshakeTimeout)
	defer cancel()
	ua, err := resolveUDP(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("peer %q: address %q: %w", node, addr, err)
	}
	tlsCfg := t.clientTLS.Clone()
	tlsCfg.ServerName = node
	tlsCfg.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
		// Vouched for now (TrustsKey), as the node we dialed, with the key
		// it gossiped.
		name, got, err := verifyNodeCert(t.dir, raw, "")
		switch {
		case err != nil:
			t.refused(err, "addr:"+hostOf(addr))
			return err
		case name != node:
			return &refusalError{why: RefusedWrongNode, node: name, msg: fmt.Sprintf("certificate is for node %q, dialed %q", name, node)}
		case !got.Equal(key):
			return &refusalError{why: RefusedKeyMismatch, node: node, msg: "peer key changed during the handshake"}
		}
		return nil
	}
	conn, err := t.qt.Dial(ctx, ua, tlsCfg, t.clientQUIC)
	if err != nil {
		return nil, fmt.Errorf("dial peer %q at %s: %w", node, addr, err)
	}
	resp, err := t.h3.NewClientConn(conn).RoundTrip(req)
	if err != nil {
		_ = conn.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), "")
		return nil, fmt.Errorf("peer %q: %w", node, err)
	}
	resp.Body = &closeConnBody{ReadCloser: resp.Body, conn: conn}
	return resp, nil
}

// closeConnBody closes its connection with the body.
type closeConnBody struct {
	io.ReadCloser
	conn *quic.Conn
}

func (b *closeConnBody) Close() error {
	err := b.ReadCloser.Close()
	_ = b.conn.CloseWithError(quic.ApplicationErrorCode(http3.ErrCodeNoError), "")
	return err
}
