package mesh

import (
	"time"

	"go.uber.org/zap"
)

// This node's own admission certificate. Peers refuse a node whose
// certificate expired, so such a node must say so loudly and not pretend
// to join; and it should warn well before that happens.

// CertWarnBefore is how long before its expiry this node's certificate is
// warned about (at most once an hour).
const CertWarnBefore = 7 * 24 * time.Hour

// CertificateExpiry returns when this node's admission certificate
// expires; false when this node has none, or when the trust configuration
// lists it statically (its certificate does not matter then).
func (m *Mesh) CertificateExpiry() (time.Time, bool) {
	if m.cert == nil {
		return time.Time{}, false
	}
	m.mu.RLock()
	s, static := m.trust.static[m.name]
	m.mu.RUnlock()
	if static && s.PublicKey.Equal(m.pub) {
		return time.Time{}, false
	}
	return m.cert.Expires, true
}

// ownCertExpired reports whether this node's certificate has expired (and
// matters), logging loudly or warning ahead as due. Heal's goroutine only.
func (m *Mesh) ownCertExpired(lastWarn *time.Time) bool {
	exp, ok := m.CertificateExpiry()
	if !ok {
		return false
	}
	now := m.cfg.Now()
	expired := !now.Before(exp)
	if time.Since(*lastWarn) < time.Hour && !lastWarn.IsZero() {
		return expired
	}
	switch {
	case expired:
		*lastWarn = time.Now()
		m.log.Error("this node's admission certificate has EXPIRED: every peer refuses it, so it does not try to join; "+
			"issue a new one (infermesh authority issue) and restart", zap.Time("expired", exp))
	case exp.Sub(now) < CertWarnBefore:
		*lastWarn = time.Now()
		m.log.Warn("this node's admission certificate expires soon; issue a new one (infermesh authority issue)",
			zap.Time("expires", exp), zap.Duration("left", exp.Sub(now).Round(time.Minute)))
	}
	return expired
}
