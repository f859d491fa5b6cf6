package mesh

import (
	"crypto/ed25519"
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
