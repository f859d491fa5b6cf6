package store

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const hashA = "a1a2a3a4a5a6a7a8a9a0b1b2b3b4b5b6b7b8b9b0c1c2c3c4c5c6c7c8c9c0d1d2"

// TestClientsPersistWithTheMirror: clients are added, changed and removed
// in the database and its mirror together; they outlive a restart and a
// damaged database (the reset restores the mirror's), and a removed one
// stays removed.
func TestClientsPersistWithTheMirror(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
	uid := uint32(1001)
	for _, c := range []Client{
		{Name: "app", KeyHash: hashA, KeyHint: "im-…abcd", Roles: []string{"chat"}, RPM: 60, Created: at, By: "uid 0"},
		{Name: "batch", UID: &uid, Priority: "low", TPM: 1000, Created: at},
		{Name: "gone", KeyHash: strings.Repeat("0", 64), Created: at},
	} {
		if err := s.AddClient(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.AddClient(Client{Name: "app"}); !errors.Is(err, ErrClientExists) {
		t.Fatalf("adding app twice: %v, want ErrClientExists", err)
	}
	if err := s.AddClient(Client{Name: "raw", KeyHash: "im-notahash"}); err == nil {
		t.Fatal("a key where the hash goes was stored")
	}
	if _, ok, err := s.UpdateClient("app", func(c *Client) { c.MaxConcurrent = 4 }); err != nil || !ok {
		t.Fatalf("UpdateClient = %v, %v", ok, err)
	}
	if _, ok, err := s.UpdateClient("nobody", func(c *Client) {}); err != nil || ok {
		t.Fatalf("UpdateClient(nobody) = %v, %v; want not found", ok, err)
	}
	if prev, ok, err := s.DeleteClient("gone"); err != nil || !ok || prev.Name != "gone" {
		t.Fatalf("DeleteClient = %+v, %v, %v", prev, ok, err)
	}
	want, _ := s.Clients()
	if len(want) != 2 || want[0].Name != "app" || want[0].MaxConcurrent != 4 || *want[1].UID != 1001 {
		t.Fatalf("Clients = %+v", want)
	}
	m, _, err := readMirror(mirrorPath(path))
	if err != nil || !sameClients(m.Clients, want) {
		t.Fatalf("mirror clients = %+v (%v), want the database's %+v", m.Clients, err, want)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = openForTest(t, path)
	if got, _ := s.Clients(); !sameClients(got, want) {
		t.Fatalf("after a restart: %+v, want %+v", got, want)
	}
	_ = s.Close()

	// The database lost: the reset brings back the mirror's clients.
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path, Options{}); !errors.Is(err, ErrMissing) {
		t.Fatalf("Open of an emptied store = %v, want ErrMissing", err)
	}
	s, err = Open(path, Options{Reset: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got, _ := s.Clients(); !sameClients(got, want) {
		t.Fatalf("after a reset: %+v, want the mirror's %+v", got, want)
	}
}

// TestClientsDivergedMirror: a database whose clients differ from its
// mirror's at the same generation is refused, not started with fewer.
func TestClientsDivergedMirror(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.AddClient(Client{Name: "app", KeyHash: hashA}); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	m, _, err := readMirror(mirrorPath(path))
	if err != nil {
		t.Fatal(err)
	}
	m.Clients = append(m.Clients, Client{Name: "extra", KeyHash: hashA})
	if err := writeMirror(mirrorPath(path), m); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path, Options{}); !errors.Is(err, ErrDiverged) {
		t.Fatalf("Open = %v, want ErrDiverged", err)
	}
}

// TestMirrorWithoutClientsStillSums: a mirror written before clients
// existed (no "clients" member) opens.
func TestMirrorWithoutClientsStillSums(t *testing.T) {
	path := storeWithPolicy(t)
	b, err := os.ReadFile(mirrorPath(path))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), `"clients"`) {
		t.Fatalf("a mirror without clients names them:\n%s", b)
	}
	openForTest(t, path)
}
