package mesh

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Confirming deaths. The gossip key is shared by every node (consumer-scope
// and revoked ones too, until the key rotates), and memberlist believes
// any holder of it that says a peer is dead. So gossip saying a peer left
// or died is a hint: before this node forgets what the peer advertised it
// asks the peer itself, over the QUIC transport, whose connections are
// pinned to the peer's node key. A peer that answers, and is not leaving,
// keeps its adverts; the false death is audited and confirmed again every
// ConfirmInterval for as long as gossip keeps saying it is gone.

// Confirmer reaches a peer over an authenticated channel. ConfirmAlive
// returns nil when node answered as itself (its pinned key) and is not
// leaving the mesh; an error otherwise (unreachable, leaving, refused).
// It must return when ctx ends and be safe for concurrent use.
type Confirmer interface {
	ConfirmAlive(ctx context.Context, node string) error
}

// AuditPeerDeathRefuted: gossip said a peer was gone, and the peer answered
// over its authenticated QUIC connection; its adverts were kept.
const AuditPeerDeathRefuted = "mesh.peer.death.refuted"

// reasonFalseDeath counts gossip deaths the peer itself refuted (a key
// holder lying, or gossip losing packets under load).
const reasonFalseDeath = "false_death"

// Defaults of confirmation.
const (
	DefaultConfirmTimeout  = 2 * time.Second
	DefaultConfirmInterval = 5 * time.Second
)

var _ Confirmer = (*Transport)(nil)

// SetConfirmer makes gossip deaths wait for c's confirmation before a
// peer's adverts are forgotten (normally the Transport that uses this Mesh
// as its directory). Without one, gossip alone decides.
func (m *Mesh) SetConfirmer(c Confirmer) { m.confirmer.Store(&c) }

// Leaving reports whether Leave was called: this node answers confirmation
// probes as leaving, so its peers forget it at once.
func (m *Mesh) Leaving() bool { return m.leaving.Load() }

// peerGone handles gossip saying p left or died: forget it at once without
// a confirmer, else confirm first (in the background: memberlist calls
// NotifyLeave with its locks held).
func (m *Mesh) peerGone(p *peer) {
	cp := m.confirmer.Load()
	if cp == nil || *cp == nil || !m.spawn(func() { m.confirmGone(*cp, p) }) {
		m.forgetPeer(p, "gossip")
	}
}

// confirmGone asks p over QUIC whether it is alive; a peer that answers is
// kept and asked again every ConfirmInterval while gossip still says it is
// gone (p is still the record in m.peers: a new alive replaced it).
func (m *Mesh) confirmGone(c Confirmer, p *peer) {
	first := true
	for {
		ctx, cancel := context.WithTimeout(m.ctx, m.cfg.ConfirmTimeout)
		err := c.ConfirmAlive(ctx, p.name)
		cancel()
		if m.ctx.Err() != nil {
			return
		}
		m.mu.RLock()
		current := m.peers[p.name] == p
		m.mu.RUnlock()
		if !current {
			return // back alive in gossip (or replaced): nothing to decide
		}
		switch {
		case Inconclusive(err):
			// Our own requests hold every stream the peer allows (the
			// probe was never sent), or the peer answers them but not
			// the probe in time: nothing was learnt of its death. Ask
			// again later; a peer that is really gone ends the
			// connection (idle timeout) and the next probe says so.
		case err != nil:
			m.forgetPeer(p, "gossip, then quic: "+err.Error())
			return
		case first:
			first = false
			m.refusals.count(auditNodeRefused, p.name, "", reasonFalseDeath)
			m.log.Warn("gossip says a peer is gone but it answers over QUIC; keeping its adverts", zap.String("peer", p.name))
			m.auditMembership(AuditPeerDeathRefuted, p.name, map[string]string{
				"evidence": "the peer answered over its authenticated QUIC connection",
				"gossip":   "left or dead (gossip names no authenticated sender)",
			})
		}
		t := time.NewTimer(m.cfg.ConfirmInterval)
		select {
		case <-m.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// forgetPeer forgets p and everything it advertised, unless a newer record
// replaced it meanwhile. evidence says what decided it, for the audit.
func (m *Mesh) forgetPeer(p *peer, evidence string) {
	m.advMu.Lock()
	defer m.advMu.Unlock()
	m.mu.Lock()
	if m.peers[p.name] != p {
		m.mu.Unlock()
		return
	}
	m.departed[p.name] = p
	delete(m.peers, p.name)
	m.unindexKeyLocked(p)
	delete(m.removed, p.name)
	m.members.Store(int64(len(m.peers) + 1))
	m.mu.Unlock()
	m.forgetOriginLocked(p.name)
	if m.sink != nil {
		m.sink.RemoveNode(p.name)
	}
	m.log.Info("peer gone (left or declared dead)", zap.String("peer", p.name), zap.String("evidence", evidence))
	m.auditMembership(AuditPeerGone, p.name, map[string]string{"evidence": evidence})
}

// spawn runs f in a goroutine owned by the Mesh (Close waits for it);
// false when the Mesh is closed.
func (m *Mesh) spawn(f func()) bool {
	m.spawnMu.Lock()
	defer m.spawnMu.Unlock()
	if m.spawnClosed {
		return false
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		f()
	}()
	return true
}

// probePath is the transport's liveness probe: served before the peer
// handler, to verified peers only.
const probePath = "/.well-known/infermesh/alive"

// ConfirmAlive asks node over QUIC (its pinned key) whether it is alive and
// not leaving: it implements Confirmer.
//
// A probe that ctx ended before it could even be sent returns ErrPeerBusy:
// the connection has every request stream the peer allows open (our own
// requests hold them), so the probe waited for one to end; that is no sign
// that the peer is silent.
//
// A probe that was sent but not answered before ctx ended returns
// ErrPeerSlow when the peer's answers to our other requests brought data
// meanwhile: its agent is working (a host short of CPU under thousands of
// streams answers late), not frozen or cut off, which send nothing.
func (t *Transport) ConfirmAlive(ctx context.Context, node string) error {
	start := time.Now()
	var sent atomic.Bool
	trace := &httptrace.ClientTrace{WroteHeaders: func() { sent.Store(true) }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodGet, "https://"+node+probePath, nil)
	if err != nil {
		return err
	}
	resp, err := t.RoundTrip(req)
	if err != nil {
		if ctx.Err() != nil && !sent.Load() && t.connected(node) {
			return fmt.Errorf("%s: %w", node, ErrPeerBusy)
		}
		if ctx.Err() != nil && sent.Load() && t.heardSince(node, start) {
			return fmt.Errorf("%s: %w", node, ErrPeerSlow)
		}
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusNoContent:
		return nil
	case http.StatusServiceUnavailable:
		return fmt.Errorf("%s: %w", node, ErrPeerLeaving)
	}
	return fmt.Errorf("%s answered %s", node, resp.Status)
}

// ErrPeerLeaving is ConfirmAlive's answer from a peer that is leaving the
// mesh: it answered (it is alive, draining), but is going.
var ErrPeerLeaving = errors.New("peer is leaving the mesh")

// ErrPeerBusy is ConfirmAlive's answer when the probe found no stream to
// be sent on before its deadline: every stream the peer allows on the
// connection is open. The peer is not known to be silent; the connection's
// idle timeout (MaxIdleTimeout) still ends it if the peer stops answering.
var ErrPeerBusy = errors.New("peer has every stream it allows open; the probe could not be sent")

// ErrPeerSlow is ConfirmAlive's answer when the probe was sent but not
// answered in time while the peer's answers to our other requests brought
// data: it is alive and working, only late. The connection's idle timeout
// still ends it if it falls silent.
var ErrPeerSlow = errors.New("peer answers other requests but not the probe in time")

// Inconclusive reports whether err, from ConfirmAlive, says nothing of
// the peer's silence: the probe could not be sent (ErrPeerBusy) or was
// answered late while the peer's answers to our other requests brought
// data (ErrPeerSlow). The connection's idle timeout still ends a peer
// that falls silent.
func Inconclusive(err error) bool {
	return errors.Is(err, ErrPeerBusy) || errors.Is(err, ErrPeerSlow)
}

// serveProbe answers ConfirmAlive: 204 while this node is in the mesh, 503
// once it is leaving.
func (t *Transport) serveProbe(w http.ResponseWriter) {
	if t.cfg.Leaving != nil && t.cfg.Leaving() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// connected reports whether our connection to node is open: a probe that
// could not be sent on it had no stream, not no connection.
func (t *Transport) connected(node string) bool {
	t.mu.Lock()
	d := t.dialed[node]
	t.mu.Unlock()
	return d != nil && d.conn.Context().Err() == nil
}

// heardFrom is when a peer's answers to our requests last brought data
// (response headers or body bytes), in Unix nanoseconds.
type heardFrom struct{ at atomic.Int64 }

func (h *heardFrom) stamp() { h.at.Store(time.Now().UnixNano()) }

// heardBody stamps its peer's heardFrom whenever a read brings data.
type heardBody struct {
	io.ReadCloser
	h *heardFrom
}

func (b *heardBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.h.stamp()
	}
	return n, err
}

// heardSince reports whether node's answers brought data at or after t.
func (t *Transport) heardSince(node string, since time.Time) bool {
	t.mu.Lock()
	h := t.heard[node]
	t.mu.Unlock()
	return h != nil && h.at.Load() >= since.UnixNano()
}
