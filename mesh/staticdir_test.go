package mesh

import (
	"crypto/ed25519"
	"testing"
)

func TestStaticDirectory(t *testing.T) {
	d := NewStaticDirectory()
	pub, _, _ := ed25519.GenerateKey(nil)
	other, _, _ := ed25519.GenerateKey(nil)
	if d.IsAdmitted("b") || d.TrustsKey("b", pub) {
		t.Fatal("an empty directory admits b")
	}
	d.Set("b", "127.0.0.1:7947", pub)
	if a, ok := d.PeerAddr("b"); !ok || a != "127.0.0.1:7947" {
		t.Errorf("PeerAddr(b) = %q, %v", a, ok)
	}
	if k, ok := d.PeerKey("b"); !ok || !k.Equal(pub) {
		t.Errorf("PeerKey(b) = %v, %v", k, ok)
	}
	if !d.TrustsKey("b", pub) || d.TrustsKey("b", other) {
		t.Error("TrustsKey must accept exactly b's listed key")
	}
	d.Remove("b")
	if d.IsAdmitted("b") || d.TrustsKey("b", pub) {
		t.Error("a removed node is still admitted")
	}
}
