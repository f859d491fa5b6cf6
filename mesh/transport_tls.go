package mesh

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"time"

	"github.com/quic-go/quic-go/http3"

	"github.com/infermesh/infermesh/identity"
)

// Reasons a peer is refused by the transport (OnRefused's why, and the keys
// of Transport.Refusals). Stable strings, fit for metrics.
const (
	RefusedNoCertificate  = "no_certificate"
	RefusedBadCertificate = "bad_certificate"
	RefusedNotAdmitted    = "not_admitted"
	RefusedKeyMismatch    = "key_mismatch"
	RefusedWrongNode      = "wrong_node"
)

// refusalError is a handshake refusal with its reason and the node the
// certificate claimed ("" when it claimed none).
type refusalError struct {
	why  string
	node string
	msg  string
}

func (e *refusalError) Error() string { return e.msg }

// NodeCertificate returns the self-signed TLS certificate a node presents
// on the QUIC transport: of its key, with the node name as subject common
// name. Nothing but the key is trusted
// in it (the verifier pins the key to the named admitted node); the validity
// window is wide because peers' clocks are never trusted.
func NodeCertificate(name string, key ed25519.PrivateKey) (tls.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("certificate serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-24 * time.Hour),
		NotAfter:              now.Add(100 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("self-signed certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("self-signed certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// verifyNodeCert checks the peer's certificate chain as presented in the TLS
// handshake: a leaf whose key is ed25519, whose common name is a node
// vouched for right now with exactly that key, and, when want is not empty
// (dialing), that node is want and a live admitted member (the one whose
// address we dialed). TLS itself proves the peer holds the private key.
func verifyNodeCert(dir PeerDirectory, rawCerts [][]byte, want string) (string, ed25519.PublicKey, error) {
	if len(rawCerts) == 0 {
		return "", nil, &refusalError{why: RefusedNoCertificate, msg: "no certificate presented"}
	}
	leaf, err := x509.ParseCertificate(rawCerts[0])
	if err != nil {
		return "", nil, &refusalError{why: RefusedBadCertificate, msg: "certificate: " + err.Error()}
	}
	key, ok := leaf.PublicKey.(ed25519.PublicKey)
	if !ok {
		return "", nil, &refusalError{why: RefusedBadCertificate, msg: "certificate key is not ed25519"}
	}
	name := leaf.Subject.CommonName
	if err := identity.ValidateNodeName(name); err != nil {
		return "", nil, &refusalError{why: RefusedBadCertificate, msg: "certificate names no node: " + err.Error()}
	}
	if want != "" && name != want {
		return "", nil, &refusalError{why: RefusedWrongNode, node: name,
			msg: fmt.Sprintf("certificate is for node %q, dialed %q", name, want)}
	}
	if want == "" {
		// Serving: the client proved it holds key. It is served when its
		// (name, key) is vouched for now, whether or not gossip lists it
		// alive: a restarted peer asks before every node has heard its
		// new incarnation, and gossip is a hint, not proof (TrustsKey).
		if dir.TrustsKey(name, key) {
			return name, key, nil
		}
		if pinned, ok := dir.PeerKey(name); ok && !pinned.Equal(key) {
			return "", nil, &refusalError{why: RefusedKeyMismatch, node: name,
				msg: fmt.Sprintf("node %q presented key %s, admitted with %s", name, identity.EncodeNodeKey(key), identity.EncodeNodeKey(pinned))}
		}
		return "", nil, &refusalError{why: RefusedNotAdmitted, node: name, msg: fmt.Sprintf("node %q is not admitted", name)}
	}
	if !dir.IsAdmitted(name) {
		return "", nil, &refusalError{why: RefusedNotAdmitted, node: name, msg: fmt.Sprintf("node %q is not admitted", name)}
	}
	pinned, ok := dir.PeerKey(name)
	if !ok {
		return "", nil, &refusalError{why: RefusedNotAdmitted, node: name, msg: fmt.Sprintf("node %q has no known key", name)}
	}
	if !pinned.Equal(key) {
		return "", nil, &refusalError{why: RefusedKeyMismatch, node: name,
			msg: fmt.Sprintf("node %q presented key %s, admitted with %s", name, identity.EncodeNodeKey(key), identity.EncodeNodeKey(pinned))}
	}
	return name, key, nil
}

// peerOfState returns the node name and key of a verified connection's peer
// certificate.
func peerOfState(cs *tls.ConnectionState) (string, ed25519.PublicKey, bool) {
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return "", nil, false
	}
	leaf := cs.PeerCertificates[0]
	key, ok := leaf.PublicKey.(ed25519.PublicKey)
	if !ok {
		return "", nil, false
	}
	return leaf.Subject.CommonName, key, true
}

// baseTLSConfig is what both sides share: TLS 1.3 only, HTTP/3, our node
// certificate, no session resumption (so no 0-RTT and every connection is
// verified afresh against admission). Chain verification is replaced by
// key pinning (VerifyPeerCertificate, set per side).
func baseTLSConfig(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		MinVersion:             tls.VersionTLS13,
		MaxVersion:             tls.VersionTLS13,
		Certificates:           []tls.Certificate{cert},
		NextProtos:             []string{http3.NextProtoH3},
		SessionTicketsDisabled: true,
		// Self-signed node certificates are pinned by key in
		// VerifyPeerCertificate; there is no CA chain to check.
		InsecureSkipVerify: true,
	}
}
