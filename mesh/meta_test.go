package mesh

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/infermesh/infermesh/identity"
)

func TestNodeMetaFitsAndRoundTrips(t *testing.T) {
	pub, priv, _ := ed25519.GenerateKey(nil)
	_, apriv, _ := ed25519.GenerateKey(nil)
	name := strings.Repeat("n", identity.MaxNodeNameLen)
	cert, _ := identity.IssueCertificate(apriv, name, pub, identity.ScopeFull, time.Hour, time.Now())
	nm := &nodeMeta{
		cluster:  strings.Repeat("c", maxClusterLen),
		key:      pub,
		quicAddr: strings.Repeat("q", maxQUICAddrLen),
		cert:     cert,
		keyFPs:   make([]identity.Fingerprint, identity.MaxGossipKeys),
	}
	b, err := nm.marshal(name, priv)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > memberlist.MetaMaxSize {
		t.Fatalf("largest meta is %d bytes, more than memberlist's %d", len(b), memberlist.MetaMaxSize)
	}
	got, err := parseMeta(name, b)
	if err != nil {
		t.Fatal(err)
	}
	if got.cluster != nm.cluster || !got.key.Equal(pub) || got.quicAddr != nm.quicAddr || got.cert.Name != name || len(got.keyFPs) != identity.MaxGossipKeys {
		t.Errorf("meta round trip = %+v", got)
	}
	if _, err := parseMeta("other", b); err == nil {
		t.Error("meta signed for one name parsed under another")
	}
	for i := range b {
		c := append([]byte(nil), b...)
		c[i] ^= 0x40
		if _, err := parseMeta(name, c); err == nil {
			t.Fatalf("meta with byte %d flipped parsed", i)
		}
	}
}

// BenchmarkMetaCacheHit measures the lookup every alive message and
// push/pull entry makes (two to three per message) once the node's meta
// is known.
func BenchmarkMetaCacheHit(b *testing.B) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		b.Fatal(err)
	}
	nm := &nodeMeta{cluster: "bench", key: priv.Public().(ed25519.PublicKey), quicAddr: "127.0.0.1:7947"}
	raw, err := nm.marshal("n1", priv)
	if err != nil {
		b.Fatal(err)
	}
	var c metaCache
	c.init()
	if _, err := c.parse("n1", raw); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.parse("n1", raw); err != nil {
			b.Fatal(err)
		}
	}
}

// The cache answers by name and exact bytes: a node's new meta is parsed
// and verified, its previous one is still known, a meta signed for
// another name is refused, and metas beyond metaPerName push the oldest
// out.
func TestMetaCache(t *testing.T) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	metas := make([][]byte, metaPerName+1)
	for i := range metas {
		nm := &nodeMeta{cluster: "c", key: priv.Public().(ed25519.PublicKey), quicAddr: fmt.Sprintf("127.0.0.1:%d", 7000+i)}
		if metas[i], err = nm.marshal("n1", priv); err != nil {
			t.Fatal(err)
		}
	}
	var c metaCache
	c.init()
	for round := range 2 {
		for i, raw := range metas {
			nm, err := c.parse("n1", raw)
			if err != nil {
				t.Fatalf("round %d meta %d: %v", round, i, err)
			}
			if want := fmt.Sprintf("127.0.0.1:%d", 7000+i); nm.quicAddr != want {
				t.Errorf("round %d meta %d: quicAddr = %q, want %q", round, i, nm.quicAddr, want)
			}
		}
	}
	if got := len(c.m["n1"]); got != metaPerName || c.n != metaPerName {
		t.Errorf("%d metas kept for n1 (%d in all), want %d", got, c.n, metaPerName)
	}
	if _, err := c.parse("n2", metas[0]); !errors.Is(err, errBadMeta) {
		t.Errorf("n1's meta as n2's: err = %v, want errBadMeta", err)
	}
}
