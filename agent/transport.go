package agent

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/proxy"
)

// This file connects the proxy to the QUIC transport between agents
// (mesh.Transport): remote candidates go out through it, ordered by the peer
// scorer, and peers' requests come in to the proxy's peer handler.

// Audit kinds of keyring changes peers send over QUIC, each with the
// sender (Node), the operation, the keys' fingerprints, and the reason and
// rotation the sender gave.
const (
	// AuditKeyringByPeer: a peer changed this node's gossip keyring (a
	// cluster-wide rotation, or the keyring given back after an unrevoke).
	AuditKeyringByPeer = "mesh.keyring.changed_by_peer"
	// AuditKeyringRefused: a peer that may not change this node's keyring
	// tried (why says what decided it: revoked, and by what; not full scope).
	AuditKeyringRefused = "mesh.keyring.refused"
	// AuditKeyringFailed: a peer's allowed change could not be made.
	AuditKeyringFailed = "mesh.keyring.failed"
)

// errNoTransport answers remote attempts before the QUIC transport runs
// (or after it stopped): the proxy skips to the next candidate.
var errNoTransport = errors.New("mesh transport not running")

// lateRemote is the proxy's Remote: the proxy is built in New, the QUIC
// transport only in Run, after the mesh that is its peer directory.
type lateRemote struct {
	tr atomic.Pointer[mesh.Transport]
}

var _ http.RoundTripper = (*lateRemote)(nil)

func (l *lateRemote) RoundTrip(r *http.Request) (*http.Response, error) {
	tr := l.tr.Load()
	if tr == nil {
		if r.Body != nil {
			_ = r.Body.Close()
		}
		return nil, errNoTransport
	}
	return tr.RoundTrip(r)
}

// progressing is the proxy's progress check of a remote attempt: node's
// agent answers over the running transport. One that is leaving still
// answers: it drains the requests it has, so they are waited for. One that
// left (no longer a member, so it cannot be asked) keeps the requests it
// drains too: they end with its connection, which is kept for as long as
// its key is trusted. One that holds every stream it allows us (all our
// requests, waiting on its instance) could not be asked, and one that
// answers our other requests but not the probe in time (short of CPU) is
// working: neither is a sign of silence, and the connection's idle timeout
// ends it if it falls silent.
func (l *lateRemote) progressing(ctx context.Context, node string) error {
	tr := l.tr.Load()
	if tr == nil {
		return errNoTransport
	}
	err := tr.ConfirmAlive(ctx, node)
	if errors.Is(err, mesh.ErrPeerLeaving) || errors.Is(err, mesh.ErrUnknownPeer) || mesh.Inconclusive(err) {
		return nil
	}
	return err
}

// newScorer wraps the placement table for the proxy when there is a mesh:
// remote candidates are ordered by what this node observes of its peers.
func (a *Agent) newScorer() (proxy.Resolver, http.RoundTripper, error) {
	if !a.config().Mesh.Enabled() {
		return a.table, nil, nil
	}
	s, err := proxy.NewPeerScorer(a.table, proxy.PeerScoreConfig{
		Graceful:  mesh.GracefulClose,
		Alive:     a.remote.progressing,
		FirstByte: a.config().Proxy.PeerFirstByteTimeout,
		// A remote attempt waits for response headers as long as a local
		// one (zero: the proxy's default too).
		HeaderTimeout: a.config().Proxy.UpstreamTimeout,
	})
	if err != nil {
		return nil, nil, err
	}
	a.scorer = s
	return s, s.Transport(&a.remote), nil
}

// startTransport binds the QUIC transport: peers' requests are served by
// the proxy's peer handler (local instances only), and this node's remote
// candidates are sent through it. Serve it, and Close it at stop.
func (a *Agent) startTransport(m *mesh.Mesh) (*mesh.Transport, error) {
	cfg := mesh.DefaultTransportConfig()
	cfg.Name = m.Name()
	cfg.Key = m.NodeKey()
	cfg.Listen = a.config().Mesh.QUIC
	cfg.Peers = m
	cfg.Handler = a.proxy.PeerHandler(mesh.PeerFromRequest, a.peerRefused)
	cfg.Logger = a.log.Named("quic")
	cfg.MaxStreamsPerPeer = a.config().Mesh.MaxStreamsPerPeer
	cfg.MaxConnsPerPeer = a.config().Mesh.MaxConnsPerPeer
	cfg.BodyTimeout = a.config().Proxy.BodyTimeout // zero: the transport's default, the proxy's too
	if a.config().Proxy.ConnectTimeout > 0 {
		cfg.HandshakeTimeout = a.config().Proxy.ConnectTimeout
	}
	cfg.Leaving = m.Leaving
	cfg.Info = a.nodeInfo
	cfg.Keyring = m
	cfg.OnKeyring = func(ev mesh.KeyringEvent) {
		kind, fields := AuditKeyringByPeer, map[string]string{
			"op": ev.Op, "fingerprint": strings.Join(ev.Fingerprints, ","), "reason": ev.Reason, "rotation": ev.Rotation,
		}
		switch {
		case ev.Refused != "":
			kind, fields["why"] = AuditKeyringRefused, ev.Refused
		case ev.Failed != "":
			kind, fields["error"] = AuditKeyringFailed, ev.Failed
		}
		a.audit.Record(Event{Kind: kind, Node: ev.Peer, Fields: fields})
	}
	cfg.OnRefused = func(peer, why string) {
		a.audit.Record(Event{Kind: mesh.AuditQUICRefused, Node: peer, Fields: map[string]string{"why": why}})
	}
	if a.opts.TransportTuning != nil {
		a.opts.TransportTuning(&cfg)
	}
	tr, err := mesh.NewTransport(cfg)
	if err != nil {
		return nil, err
	}
	// Gossip saying a peer is gone is confirmed over QUIC before its
	// adverts are forgotten.
	m.SetConfirmer(tr)
	a.remote.tr.Store(tr)
	a.mu.Lock()
	a.transport = tr
	a.mu.Unlock()
	return tr, nil
}

// serveTransport runs tr until ctx ends or it is shut down.
func (a *Agent) serveTransport(ctx context.Context, tr *mesh.Transport) {
	if err := tr.Serve(ctx); err != nil {
		a.log.Error("mesh transport stopped; peers cannot reach this node", zap.Error(err))
	}
}

// shutdownTransport stops taking peers' requests and waits for those in
// flight until ctx ends.
func (a *Agent) shutdownTransport(ctx context.Context) {
	a.mu.Lock()
	tr := a.transport
	a.mu.Unlock()
	if tr == nil {
		return
	}
	a.remote.tr.Store(nil)
	if err := tr.Shutdown(ctx); err != nil {
		a.log.Warn("peer requests cut at stop", zap.Error(err))
	}
}

// peerRefused is the peer handler's refusal hook. The placement table
// already audited the refusal (infer.peer.refused, with the reason); this
// adds the connection it came from to the debug log.
func (a *Agent) peerRefused(r *http.Request, peer, role, why string) {
	a.log.Debug("peer request refused", zap.String("peer", peer), zap.String("role", role),
		zap.String("why", why), zap.String("remote", r.RemoteAddr))
}

// Transport returns the agent's QUIC transport, nil without a mesh or
// before Run started it.
func (a *Agent) Transport() *mesh.Transport {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.transport
}

// PeerScores returns what this node observes of its peers (in flight,
// failures, cool-downs); nil without a mesh.
func (a *Agent) PeerScores() []proxy.PeerScore {
	if a.scorer == nil {
		return nil
	}
	return a.scorer.Peers()
}
