package mesh

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

// deadPacket builds what any holder of the gossip key can send: a
// memberlist `dead` message for node, encrypted with key and labelled with
// the cluster, as one UDP packet (memberlist's wire format: label header,
// then version 1 AES-GCM with the label as additional data, then the
// message type and the msgpack body).
func deadPacket(t *testing.T, key []byte, label, node, from string, incarnation uint32) []byte {
	t.Helper()
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	msg := []byte{5, 0x83} // deadMsg, a map of 3
	msg = str(msg, "Incarnation")
	msg = binary.BigEndian.AppendUint32(append(msg, 0xce), incarnation)
	msg = str(str(msg, "Node"), node)
	msg = str(str(msg, "From"), from)
	block, err := aes.NewCipher(key)
	if err != nil {
		t.Fatal(err)
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, gcm.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		t.Fatal(err)
	}
	pkt := append([]byte{244, byte(len(label))}, label...)
	pkt = append(append(pkt, 1), nonce...)
	return gcm.Seal(pkt, nonce, msg, []byte(label))
}

// deathForger returns a function that sends to a, from a process holding
// only the gossip key, a `dead` message for a node, with a higher
// incarnation each time.
func deathForger(t *testing.T, a *testNode) func(node string) {
	t.Helper()
	keys, err := identity.LoadKeyring(a.m.cfg.KeyringPath)
	if err != nil {
		t.Fatal(err)
	}
	attacker, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { attacker.Close() })
	to, err := net.ResolveUDPAddr("udp", a.m.GossipAddr())
	if err != nil {
		t.Fatal(err)
	}
	inc := uint32(1000)
	return func(node string) {
		inc++
		if _, err := attacker.WriteTo(deadPacket(t, keys[0], "test", node, "x", inc), to); err != nil {
			t.Fatal(err)
		}
	}
}

// runTransport starts a transport from cfg and serves it until the test
// ends.
func runTransport(t *testing.T, cfg TransportConfig) *Transport {
	t.Helper()
	tr, err := NewTransport(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = tr.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done; tr.Close() })
	return tr
}

// quicNode gives n a QUIC transport on its own address, serving every
// request with 200 and confirming gossip deaths when confirm is set.
func quicNode(t *testing.T, n *testNode, pc net.PacketConn, confirm bool) *Transport {
	t.Helper()
	tr := runTransport(t, TransportConfig{Name: n.name, Key: n.m.NodeKey(), PacketConn: pc, Peers: n.m, Handler: echoHandler(),
		KeepAlivePeriod: 100 * time.Millisecond, MaxIdleTimeout: time.Second, Leaving: n.m.Leaving, Keyring: n.m})
	if confirm {
		n.m.SetConfirmer(tr)
	}
	return tr
}

// quicPair starts a and b, each with a QUIC transport (confirming gossip
// deaths when confirm is set); b serves chat, which a accepts.
func quicPair(t *testing.T, confirm bool) (a, b *testNode) {
	t.Helper()
	c := newTestCluster(t)
	var pcs []net.PacketConn
	c.tweak = func(cfg *Config) {
		pc, err := net.ListenPacket("udp", cfg.BindAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		pcs = append(pcs, pc)
		cfg.QUICAddr = pc.LocalAddr().String()
	}
	a, b = c.node("a"), c.node("b")
	a.tab.AllowRemoteNode("chat", "b", true)
	b.serve(t, "chat", "m")
	b.join(t, a)
	quicNode(t, a, pcs[0], confirm)
	quicNode(t, b, pcs[1], confirm)
	eventually(t, 10*time.Second, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	return a, b
}

// TestForgedDeathIsRefutedOverQUIC: a process with no admission at all,
// holding only the gossip key, tells a that b is dead, again and again.
// With deaths confirmed over QUIC, a never stops resolving chat to b, and
// audits the refuted death; without confirmation the same attack takes b's
// roles off a (which shows the attack is real).
func TestForgedDeathIsRefutedOverQUIC(t *testing.T) {
	for _, confirm := range []bool{true, false} {
		name := map[bool]string{true: "confirmed over QUIC", false: "gossip alone"}[confirm]
		t.Run(name, func(t *testing.T) {
			a, _ := quicPair(t, confirm)

			forgeDeath := deathForger(t, a)
			lost := 0
			for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
				forgeDeath("b")
				for range 10 {
					if !a.resolvesTo("chat", "b") {
						lost++
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			if confirm {
				if lost != 0 {
					t.Errorf("a did not resolve chat to b in %d samples during the attack, want 0", lost)
				}
				if !a.audit.membership(AuditPeerDeathRefuted, "b") {
					t.Errorf("the refuted death was not audited")
				}
				if a.refusals(reasonFalseDeath) == 0 {
					t.Errorf("the refuted death was not counted")
				}
			} else {
				t.Logf("gossip alone: chat not resolved to b in %d samples", lost)
				if lost == 0 {
					t.Errorf("the forged deaths never took chat off a: the attack did not reach it")
				}
			}
		})
	}
}

// TestLeaveIsNotRefuted: a peer that leaves answers the probe as leaving,
// so it is forgotten at once even though its QUIC transport still runs.
func TestLeaveIsNotRefuted(t *testing.T) {
	a, b := quicPair(t, true)
	if err := b.m.Leave(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "a forgets b", func() bool { return !a.resolvesTo("chat", "b") })
	if a.audit.membership(AuditPeerDeathRefuted, "b") {
		t.Errorf("a refuted b's leave")
	}
}

// busyConfirmer answers every probe as a peer whose streams our own
// requests all hold: the probe could not be sent.
type busyConfirmer struct{ probes atomic.Int64 }

func (c *busyConfirmer) ConfirmAlive(context.Context, string) error {
	c.probes.Add(1)
	return ErrPeerBusy
}

// TestBusyPeerIsNotForgottenOnGossipDeath: gossip says b is dead while
// every stream b allows is held by a's own requests, so the confirming
// probe cannot be sent (ErrPeerBusy). That proves nothing either way: a
// keeps b's adverts (and asks again later) instead of forgetting it, and
// does not audit a refutation it never got.
func TestBusyPeerIsNotForgottenOnGossipDeath(t *testing.T) {
	a, _ := quicPair(t, true)
	busy := &busyConfirmer{}
	a.m.SetConfirmer(busy)
	forgeDeath := deathForger(t, a)
	lost := 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end) || busy.probes.Load() == 0; {
		forgeDeath("b")
		for range 10 {
			if !a.resolvesTo("chat", "b") {
				lost++
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if lost != 0 {
		t.Errorf("a did not resolve chat to b in %d samples while b was busy, want 0", lost)
	}
	if a.audit.membership(AuditPeerDeathRefuted, "b") {
		t.Errorf("a audited a refutation b never gave")
	}
}
