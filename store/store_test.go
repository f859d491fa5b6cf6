package store

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

func openForTest(t *testing.T, path string) *Store {
	t.Helper()
	s, err := Open(path, Options{LockTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestPutListDeletePersist(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", FileName)
	s := openForTest(t, path)
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	puts := []Override{
		{Kind: KindServeTo, Role: "chat", Node: "b", On: true, At: at, By: "uid 0"},
		{Kind: KindAcceptFrom, Role: "chat", Node: "c", On: false, At: at, By: "uid 0"},
		{Kind: KindExpose, Role: "chat", On: true, At: at},
		{Kind: KindRevoke, Node: "evil", On: true, At: at},
	}
	for _, o := range puts {
		if _, had, err := s.Put(o); err != nil || had {
			t.Fatalf("Put(%+v) = had %v, %v; want new", o, had, err)
		}
	}
	prev, had, err := s.Put(Override{Kind: KindServeTo, Role: "chat", Node: "b", On: false, At: at})
	if err != nil || !had || !prev.On {
		t.Fatalf("Put over an existing override = %+v, %v, %v; want the previous (on)", prev, had, err)
	}
	want := []Override{
		{Kind: KindAcceptFrom, Role: "chat", Node: "c", On: false, At: at, By: "uid 0"},
		{Kind: KindExpose, Role: "chat", On: true, At: at},
		{Kind: KindRevoke, Node: "evil", On: true, At: at},
		{Kind: KindServeTo, Role: "chat", Node: "b", On: false, At: at},
	}
	got, err := s.Overrides()
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("Overrides() = %+v, %v;\nwant %+v", got, err, want)
	}

	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("database mode = %v, %v; want 0600", st.Mode().Perm(), err)
	}

	// Reopen: everything is still there.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	s = openForTest(t, path)
	if got, err := s.Overrides(); err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("after reopen Overrides() = %+v, %v; want %+v", got, err, want)
	}

	if prev, had, err := s.Delete(Key{KindRevoke, "", "evil"}); err != nil || !had || prev.Node != "evil" {
		t.Errorf("Delete(revoke evil) = %+v, %v, %v; want the override", prev, had, err)
	}
	if _, had, err := s.Delete(Key{KindRevoke, "", "evil"}); err != nil || had {
		t.Errorf("second Delete = had %v, %v; want nothing", had, err)
	}
}

func TestReset(t *testing.T) {
	s := openForTest(t, filepath.Join(t.TempDir(), FileName))
	for _, o := range []Override{
		{Kind: KindServeTo, Role: "chat", Node: "b", On: true},
		{Kind: KindAcceptFrom, Role: "chat", Node: "b", On: true},
		{Kind: KindAcceptFrom, Role: "embed", Node: "b", On: true},
		{Kind: KindExpose, Role: "embed", On: true},
	} {
		if _, _, err := s.Put(o); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		f        Filter
		gone     int
		left     int
		leftKind Kind
	}{
		{Filter{Role: "chat", Kind: KindServeTo}, 1, 3, ""},
		{Filter{Node: "b"}, 2, 1, KindExpose},
		{Filter{}, 1, 0, ""},
	}
	for _, tt := range tests {
		gone, err := s.Reset(tt.f)
		if err != nil || len(gone) != tt.gone {
			t.Fatalf("Reset(%+v) = %d, %v; want %d", tt.f, len(gone), err, tt.gone)
		}
		left, _ := s.Overrides()
		if len(left) != tt.left {
			t.Fatalf("after Reset(%+v): %d left, want %d", tt.f, len(left), tt.left)
		}
		if tt.leftKind != "" && left[0].Kind != tt.leftKind {
			t.Errorf("after Reset(%+v): left %v, want %s", tt.f, left, tt.leftKind)
		}
	}
}

func TestValidate(t *testing.T) {
	s := openForTest(t, filepath.Join(t.TempDir(), FileName))
	bad := []Override{
		{Kind: "other", Role: "chat", Node: "b"},
		{Kind: KindServeTo, Role: "chat"},
		{Kind: KindAcceptFrom, Node: "b"},
		{Kind: KindExpose, Role: "chat", Node: "b"},
		{Kind: KindRevoke, Role: "chat", Node: "b"},
		{Kind: KindRevoke},
		{Kind: KindServeTo, Role: "ch\x00at", Node: "b"},
		{Kind: KindSignedRevoke, Node: "b", On: true},                  // no statement
		{Kind: KindRevoke, Node: "b", On: true, Statement: "c2lnbmVk"}, // a statement with a local revocation
	}
	for _, o := range bad {
		if _, _, err := s.Put(o); err == nil {
			t.Errorf("Put(%+v) succeeded, want an error", o)
		}
	}
	if got, _ := s.Overrides(); len(got) != 0 {
		t.Errorf("Overrides() = %v after refused puts, want none", got)
	}
}

func TestLockedByAnother(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	openForTest(t, path)
	_, err := Open(path, Options{LockTimeout: 50 * time.Millisecond})
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Open = %v, want ErrLocked", err)
	}
}

// TestSignedRevocationsOutliveResetAndDamage: a signed revocation is the
// authority's word: `policy reset` never drops it, and a damaged database
// gets it back from the mirror like every override.
func TestSignedRevocationsOutliveResetAndDamage(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	signed := Override{Kind: KindSignedRevoke, Node: "c", On: true, At: at, Statement: "c3RhdGVtZW50"}
	for _, o := range []Override{signed, {Kind: KindRevoke, Node: "d", On: true, At: at}} {
		if _, _, err := s.Put(o); err != nil {
			t.Fatal(err)
		}
	}
	gone, err := s.Reset(Filter{})
	if err != nil || len(gone) != 1 || gone[0].Kind != KindRevoke {
		t.Fatalf("Reset(all) = %+v, %v; want only the local revocation", gone, err)
	}
	if gone, err := s.Reset(Filter{Kind: KindSignedRevoke}); err != nil || len(gone) != 0 {
		t.Fatalf("Reset(signed_revoke) = %+v, %v; want nothing removed", gone, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("not a database"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err = Open(path, Options{Reset: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.Overrides()
	if err != nil || !reflect.DeepEqual(got, []Override{signed}) {
		t.Errorf("after a reset from the mirror: %+v, %v; want %+v", got, err, signed)
	}
}
