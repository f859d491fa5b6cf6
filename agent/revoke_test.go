package agent

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/store"
)

// hostilePeer is a QUIC client of its own, built on quic-go rather than on
// the agent's transport, that presents a node's key: what a node that was
// admitted (and is revoked now) can do with its key, whatever its agent's
// code would.
type hostilePeer struct {
	t    *testing.T
	cert tls.Certificate
}

func newHostilePeer(t *testing.T, n *meshNode) *hostilePeer {
	t.Helper()
	key, err := identity.LoadKey(filepath.Join(n.stateDir, identity.NodeKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	return &hostilePeer{t: t, cert: selfSigned(t, n.name, key)}
}

// dial opens a QUIC connection to addr as the node; a refused handshake
// may only show on the first request (TLS 1.3 clients finish first).
func (h *hostilePeer) dial(ctx context.Context, addr string) (*http3.ClientConn, *quic.Conn, error) {
	tc := &tls.Config{Certificates: []tls.Certificate{h.cert}, InsecureSkipVerify: true, NextProtos: []string{http3.NextProtoH3},
		MinVersion: tls.VersionTLS13}
	conn, err := quic.DialAddr(ctx, addr, tc, &quic.Config{})
	if err != nil {
		return nil, nil, err
	}
	h.t.Cleanup(func() { conn.CloseWithError(0, "") })
	return (&http3.Transport{}).NewClientConn(conn), conn, nil
}

// keyring sends one keyring change on cc; the answer's status, or the
// error that ended the request.
func (h *hostilePeer) keyring(ctx context.Context, cc *http3.ClientConn, op mesh.KeyringOp) (int, error) {
	b, _ := json.Marshal(op)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://peer/.well-known/infermesh/keyring", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// fingerprints lists n's gossip keys by fingerprint, primary first.
func fingerprints(n *meshNode) []string {
	keys, _ := n.agent.Mesh().ListKeys()
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = k.Fingerprint.String()
	}
	return out
}

func fingerprintOf(t *testing.T, key string) string {
	raw, err := identity.ParseGossipKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return identity.GossipKeyFingerprint(raw).String()
}

// auditedBy reports whether n audited an event of kind from node whose
// field k contains v.
func (n *meshNode) auditedBy(kind, node, k, v string) bool {
	return slices.ContainsFunc(n.agent.Audit().Recent(), func(e Event) bool {
		return e.Kind == kind && e.Node == node && strings.Contains(e.Fields[k], v)
	})
}

// startChatPair starts a, which accepts chat from b, and b, which serves
// chat to a from an instance of its own; bRoles starts b again.
func (tm *testMesh) startChatPair() (a, b *meshNode, bRoles map[string]roleSpec) {
	tm.t.Helper()
	ub := startUpstream(tm.t, "model-b", 0)
	bRoles = map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}
	a = tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	b = tm.start("b", bRoles, false)
	return a, b, bRoles
}

// TestSignedRevocationHoldsOnEveryAgent: three agents admitted by an
// authority's certificates, each with its own keyring file. While c is
// admitted it installs a key of its own on b (as any full-scope node may).
// Then c is revoked on a with the authority key. The bound: by the time
// `revoke` answers, a and b hold the signed statement (b got it over QUIC)
// and hold only the new gossip key, which c never had (c's own key on b is
// gone too), so c can change no agent's keyring and can neither read nor
// speak gossip anywhere from that moment; it loses the mesh within their
// failure detection (measured below). A hostile peer with c's key tries
// keyring install, use, remove and retain on b, on a connection it opened
// while admitted and on new ones: every attempt is refused, and b audits
// the refusals with c as the sender and the statement as the evidence. b
// restarts: the statement is in its state store and its mirror, and b
// refuses c from its first moment.
func TestSignedRevocationHoldsOnEveryAgent(t *testing.T) {
	_, auth, _ := ed25519.GenerateKey(nil)
	tm := newTestMesh(t, "a", "b", "c")
	tm.authority, tm.ownKeyrings = auth, true
	// b re-checks the connection c opened while admitted only when c uses
	// it (its re-check loop would otherwise close it within 50ms): so c's
	// attempts below reach the keyring handler.
	tm.transportTuning = func(name string, c *mesh.TransportConfig) {
		if name == "b" {
			c.RecheckInterval = time.Hour
		}
	}
	a, b, bRoles := tm.startChatPair()
	c := tm.start("c", map[string]roleSpec{"x": {}}, false)
	// b must know c too before c's connection below: b admits a QUIC peer
	// by the key its gossip carries.
	waitFor(t, "the mesh forms and a serves chat from b", func() bool {
		for _, n := range []*meshNode{a, b, c} {
			if !slices.Equal(members(n.agent.Mesh()), []string{"a", "b", "c"}) {
				return false
			}
		}
		return a.resolvesTo("chat", "b") && chatOK(t, a)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	h := newHostilePeer(t, c)
	cc, _, err := h.dial(ctx, b.quic)
	if err != nil {
		t.Fatal(err)
	}
	own, _ := identity.NewGossipKey()
	ownFP := fingerprintOf(t, own)
	if st, err := h.keyring(ctx, cc, mesh.KeyringOp{Op: mesh.KeyringOpInstall, Key: own, Reason: "c's own", Rotation: ownFP}); st != http.StatusNoContent {
		t.Fatalf("admitted c installing a key on b = %d, %v; want 204 (full-scope nodes may)", st, err)
	}
	if !slices.Contains(fingerprints(b), ownFP) {
		t.Fatal("b does not hold the key c installed")
	}
	cKeys := fingerprints(c)

	ac := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer ac.Close()
	now := time.Now()
	st, err := identity.IssueRevocation(auth, "c", true, identity.NextRevocationSerial(now, 0), now)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	res, err := ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "c", On: true, Statement: st.String()})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("revoke c --authority-key answered after %v: %s", time.Since(start).Round(time.Millisecond), res.Note)
	if !res.Changed || !strings.Contains(res.Note, "sent over QUIC to b") || !strings.Contains(res.Note, "rotated") ||
		strings.Contains(res.Note, "not reached") {
		t.Errorf("revoke note %q, want the statement and the rotation to have reached b", res.Note)
	}

	// At once, on every agent that is not c.
	newKeys := fingerprints(a)
	for _, n := range []*meshNode{a, b} {
		if r, ok := n.agent.Mesh().Revocation("c"); !ok || r.Serial != st.Serial || !r.Revoked {
			t.Errorf("%s holds %v, %v; want the signed revocation", n.name, r, ok)
		}
		got := fingerprints(n)
		if len(got) != 1 || !slices.Equal(got, newKeys) || slices.Contains(cKeys, got[0]) || got[0] == ownFP {
			t.Errorf("%s holds keys %v; want only the new key %v, which c (holding %v, and %s it installed) never had", n.name, got, newKeys, cKeys, ownFP)
		}
	}
	key2, _ := identity.NewGossipKey()
	attempts := []mesh.KeyringOp{
		{Op: mesh.KeyringOpInstall, Key: key2},
		{Op: mesh.KeyringOpUse, Key: own},
		{Op: mesh.KeyringOpRemove, Key: key2},
		{Op: mesh.KeyringOpRetain, Keep: []string{own}},
	}
	for _, op := range attempts {
		op.Reason, op.Rotation = "c takes the mesh back", ownFP
		if st, err := h.keyring(ctx, cc, op); st != http.StatusForbidden {
			t.Errorf("revoked c's %s on its open connection to b = %d, %v; want 403", op.Op, st, err)
		}
		waitFor(t, "b audits c's refused "+op.Op, func() bool {
			return b.auditedBy(AuditKeyringRefused, "c", "why", "signed by authority") && b.auditedBy(AuditKeyringRefused, "c", "op", op.Op)
		})
	}
	for _, n := range []*meshNode{a, b} {
		ncc, conn, err := h.dial(ctx, n.quic)
		if err == nil {
			op := mesh.KeyringOp{Op: mesh.KeyringOpInstall, Key: key2, Reason: "c takes the mesh back", Rotation: ownFP}
			if st, err := h.keyring(ctx, ncc, op); err == nil {
				t.Errorf("revoked c's new connection to %s: keyring install answered %d, want the handshake refused", n.name, st)
			}
			conn.CloseWithError(0, "")
		}
		waitFor(t, n.name+" audits c's refused handshake", func() bool { return n.auditedBy(mesh.AuditQUICRefused, "c", "why", mesh.RefusedNotAdmitted) })
	}
	// c's own agent, through its own transport.
	op := mesh.KeyringOp{Op: mesh.KeyringOpInstall, Key: key2, Reason: "c takes the mesh back", Rotation: ownFP}
	for _, peer := range []string{"a", "b"} {
		if err := c.agent.Transport().PushKeyring(ctx, peer, op); err == nil {
			t.Errorf("c's agent changed %s's keyring after its revocation", peer)
		}
	}
	for _, n := range []*meshNode{a, b} {
		if got := fingerprints(n); !slices.Equal(got, newKeys) {
			t.Errorf("after c's attempts %s holds %v, want %v", n.name, got, newKeys)
		}
	}

	// c can read nothing a and b send, and they drop what it sends: it
	// loses the mesh everywhere.
	waitFor(t, "c loses the mesh, and a and b forget c", func() bool {
		return slices.Equal(members(c.agent.Mesh()), []string{"c"}) &&
			slices.Equal(members(a.agent.Mesh()), []string{"a", "b"}) && slices.Equal(members(b.agent.Mesh()), []string{"a", "b"})
	})
	t.Logf("c lost the mesh everywhere %v after the revocation", time.Since(start).Round(time.Millisecond))
	if !chatOK(t, a) {
		t.Error("after the revocation a does not serve chat from b")
	}

	// Persisted with the mirror: b restarts and refuses c at once.
	mirror, err := os.ReadFile(filepath.Join(b.stateDir, store.MirrorFileName))
	if err != nil || !strings.Contains(string(mirror), `"kind": "signed_revoke"`) || !strings.Contains(string(mirror), st.String()) {
		t.Errorf("b's policy mirror does not hold the statement (%v):\n%s", err, mirror)
	}
	tm.stop("b")
	b = tm.start("b", bRoles, false)
	cKey, _ := identity.ParsePublicKey(c.pub)
	if r, ok := b.agent.Mesh().Revocation("c"); !ok || r.Serial != st.Serial {
		t.Errorf("restarted b holds %v, %v; want the signed revocation from its store", r, ok)
	}
	if err := b.agent.Mesh().MayChangeKeyring("c", cKey); err == nil {
		t.Error("restarted b would take keyring changes from c")
	}
	waitFor(t, "restarted b is back, and a serves chat from it", func() bool { return a.resolvesTo("chat", "b") && chatOK(t, a) })
	if slices.Contains(members(b.agent.Mesh()), "c") {
		t.Error("restarted b lists c")
	}
}

// TestUnrevokeBringsTheNodeBack: b is revoked on a (locally: static
// trust), the gossip key rotates to a and c, and b, left with the old key,
// can read none of their gossip: a forgets it. `unrevoke b` gives b the current keyring over QUIC (b is
// no live member of a's gossip any more: it is reached at the address it
// last gossiped), and b serves a again with no other step.
func TestUnrevokeBringsTheNodeBack(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	tm.ownKeyrings = true
	a, b, _ := tm.startChatPair()
	c := tm.start("c", map[string]roleSpec{"x": {}}, false)
	waitFor(t, "the mesh forms and a serves chat from b", func() bool {
		return slices.Equal(members(c.agent.Mesh()), []string{"a", "b", "c"}) && a.resolvesTo("chat", "b") && chatOK(t, a)
	})
	ac := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer ac.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "b", On: true})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.Note, "revoked on this node only") || !strings.Contains(res.Note, "rotated") {
		t.Errorf("revoke without the authority key: note %q, want it to say the revocation is local, and a rotation", res.Note)
	}
	// c still trusts b and answers it over QUIC, so each keeps the other
	// listed (gossip deaths are confirmed over QUIC); but b shares no key
	// with a or c any more.
	waitFor(t, "a and b lose each other", func() bool {
		return !slices.Contains(members(b.agent.Mesh()), "a") && slices.Equal(members(a.agent.Mesh()), []string{"a", "c"})
	})
	if got, theirs := fingerprints(b), fingerprints(a); slices.Contains(theirs, got[0]) || len(got) != 1 {
		t.Fatalf("revoked b holds %v, a holds %v: want b left with the old key only", got, theirs)
	}

	start := time.Now()
	res, err = ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "b", On: false})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("unrevoke b answered after %v: %s", time.Since(start).Round(time.Millisecond), res.Note)
	if !strings.Contains(res.Note, "b was given this node's gossip keyring over QUIC") {
		t.Errorf("unrevoke note %q, want b given the keyring", res.Note)
	}
	if got, want := fingerprints(b), fingerprints(a); !slices.Equal(got, want) {
		t.Errorf("after unrevoke b holds %v, want a's keyring %v", got, want)
	}
	if !b.auditedBy(AuditKeyringByPeer, "a", "reason", "unrevoked b") {
		t.Error("b did not audit the keyring a gave it, with a as the sender and the reason")
	}
	waitFor(t, "b serves a again", func() bool {
		return a.resolvesTo("chat", "b") && chatOK(t, a) && slices.Equal(members(c.agent.Mesh()), []string{"a", "b", "c"})
	})
	t.Logf("b served a again %v after unrevoke", time.Since(start).Round(time.Millisecond))
}

// TestUnrevokeOfUnreachableNodeSaysWhatToRun: b is revoked and then
// stopped, so `unrevoke b` cannot give it the keyring over QUIC: it says
// so and prints the commands to run on b. Running them (the keyring file
// copied, the agent restarted) brings b back.
func TestUnrevokeOfUnreachableNodeSaysWhatToRun(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.ownKeyrings = true
	a, b, bRoles := tm.startChatPair()
	waitFor(t, "a serves chat from b", func() bool { return a.resolvesTo("chat", "b") && chatOK(t, a) })
	ac := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer ac.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "b", On: true}); err != nil {
		t.Fatal(err)
	}
	tm.stop("b")
	res, err := ac.SetPolicy(ctx, admin.PolicyChange{Kind: admin.KindRevoke, Node: "b", On: false})
	if err != nil {
		t.Fatal(err)
	}
	aKeyring := a.agent.Mesh().KeyringPath()
	host := strings.Split(a.bind, ":")[0]
	for _, want := range []string{
		"b was not given the gossip key",
		"On b, run: `scp -p " + host + ":" + aKeyring + " " + aKeyring + " && systemctl restart infermeshd`",
		"run `infermesh unrevoke b` here again",
	} {
		if !strings.Contains(res.Note, want) {
			t.Errorf("unrevoke of a stopped b: note %q\nwant it to contain %q", res.Note, want)
		}
	}
	// What the commands do: b's keyring file becomes a's, and b starts.
	data, err := os.ReadFile(aKeyring)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tm.keyringOf(b), data, 0o600); err != nil {
		t.Fatal(err)
	}
	tm.start("b", bRoles, false)
	waitFor(t, "b serves a again", func() bool { return a.resolvesTo("chat", "b") && chatOK(t, a) })
}
