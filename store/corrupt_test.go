package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// policyForTest is what each corruption test stores first: a revocation
// (what must never be lost in silence) and a grant.
var policyForTest = []Override{
	{Kind: KindRevoke, Node: "evil", On: true, At: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), By: "uid 0"},
	{Kind: KindServeTo, Role: "chat", Node: "b", On: true, At: time.Date(2026, 1, 2, 3, 4, 6, 0, time.UTC)},
}

// storeWithPolicy makes a closed store at dir/state.db holding
// policyForTest and returns its path.
func storeWithPolicy(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), FileName)
	s, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range policyForTest {
		if _, _, err := s.Put(o); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func pageSizeOf(t *testing.T, path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m, err := parseMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	return int64(m.pageSize)
}

// garbageAt writes n bytes of garbage at off.
func garbageAt(t *testing.T, path string, off, n int64) {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xA5, 0x3C, 0xFF, 0x01}, int(n/4)), off); err != nil {
		t.Fatal(err)
	}
}

// freelistPage is the freelist's page id in the newest valid meta.
func freelistPage(t *testing.T, path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ps := pageSizeOf(t, path)
	best, pg := uint64(0), int64(-1)
	for i := range int64(2) {
		page := b[i*ps:]
		if m, err := parseMeta(page); err == nil && (pg < 0 || m.txid > best) {
			best = m.txid
			pg = int64(binary.LittleEndian.Uint64(page[pageHeaderSize+32:]))
		}
	}
	return pg
}

// TestCorruptStore: every kind of damage is refused with an error naming
// the file (never a crash, never a silent start without the policy), and
// -reset-state (Options.Reset) starts over with the mirror's overrides,
// revocation included, keeping the damaged file aside.
func TestCorruptStore(t *testing.T) {
	tests := []struct {
		name    string
		damage  func(t *testing.T, path string)
		want    error
		inError string // the file the error must name
	}{
		{"truncated", func(t *testing.T, path string) {
			if err := os.Truncate(path, 2*pageSizeOf(t, path)+100); err != nil {
				t.Fatal(err)
			}
		}, ErrCorrupt, FileName},
		{"zero bytes", func(t *testing.T, path string) {
			if err := os.Truncate(path, 0); err != nil {
				t.Fatal(err)
			}
		}, ErrMissing, FileName},
		{"missing", func(t *testing.T, path string) {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
		}, ErrMissing, FileName},
		{"garbage over meta page 0", func(t *testing.T, path string) {
			garbageAt(t, path, 0, pageSizeOf(t, path))
		}, ErrCorrupt, FileName},
		{"garbage over meta page 1", func(t *testing.T, path string) {
			ps := pageSizeOf(t, path)
			garbageAt(t, path, ps+pageHeaderSize, 64)
		}, ErrCorrupt, FileName},
		{"garbage over the freelist", func(t *testing.T, path string) {
			ps := pageSizeOf(t, path)
			garbageAt(t, path, freelistPage(t, path)*ps, ps)
		}, ErrCorrupt, FileName},
		{"garbage over every data page", func(t *testing.T, path string) {
			ps := pageSizeOf(t, path)
			st, _ := os.Stat(path)
			garbageAt(t, path, 2*ps, st.Size()-2*ps)
		}, ErrCorrupt, FileName},
		{"an older copy of the database", func(t *testing.T, path string) {
			// A backup restored over a newer store: the mirror is two
			// changes ahead (the grant, then the revocation of "late").
			old, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			s, err := Open(path, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := s.Put(Override{Kind: KindRevoke, Node: "late", On: true}); err != nil {
				t.Fatal(err)
			}
			if _, _, err := s.Delete(Key{KindRevoke, "", "late"}); err != nil {
				t.Fatal(err)
			}
			s.Close()
			if err := os.WriteFile(path, old, 0o600); err != nil {
				t.Fatal(err)
			}
		}, ErrDiverged, FileName},
		{"garbage in the mirror", func(t *testing.T, path string) {
			garbageAt(t, mirrorPath(path), 20, 16)
		}, ErrCorrupt, MirrorFileName},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := storeWithPolicy(t)
			tt.damage(t, path)
			s, err := Open(path, Options{LockTimeout: 50 * time.Millisecond})
			if err == nil {
				s.Close()
				t.Fatalf("Open of a damaged store succeeded; want %v", tt.want)
			}
			if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.inError) {
				t.Fatalf("Open = %v; want %v naming %s", err, tt.want, tt.inError)
			}
			if !strings.Contains(err.Error(), filepath.Dir(path)) {
				t.Errorf("Open = %v; want the file's full path", err)
			}

			s, err = Open(path, Options{LockTimeout: 50 * time.Millisecond, Reset: true})
			if err != nil {
				t.Fatalf("Open with Reset = %v", err)
			}
			defer s.Close()
			got, err := s.Overrides()
			if err != nil || !reflect.DeepEqual(got, policyForTest) {
				t.Errorf("after the reset Overrides() = %+v, %v;\nwant %+v (from the mirror)", got, err, policyForTest)
			}
			if len(s.Notes()) == 0 {
				t.Error("the reset left no note for the log")
			}
			aside, _ := filepath.Glob(filepath.Join(filepath.Dir(path), "*.bad-*"))
			if tt.want != ErrMissing && len(aside) == 0 {
				t.Errorf("the damaged file was not kept aside (notes %q)", s.Notes())
			}
			// The new store and its mirror agree: the next start is clean.
			s.Close()
			s2, err := Open(path, Options{LockTimeout: 50 * time.Millisecond})
			if err != nil {
				t.Fatalf("Open after the reset = %v", err)
			}
			if n := s2.Notes(); len(n) != 0 {
				t.Errorf("Open after the reset noted %q, want nothing", n)
			}
			s2.Close()
		})
	}
}

// TestMirrorAheadByOneChange: a stop between the mirror's write and the
// database's commit leaves the mirror one change ahead; Open applies it
// (the operator's change) and says so.
func TestMirrorAheadByOneChange(t *testing.T) {
	path := storeWithPolicy(t)
	m, _, err := readMirror(mirrorPath(path))
	if err != nil {
		t.Fatal(err)
	}
	m.Generation++
	m.Overrides = append(m.Overrides, Override{Kind: KindRevoke, Node: "late", On: true, At: time.Date(2026, 1, 3, 0, 0, 0, 0, time.UTC)})
	if err := writeMirror(mirrorPath(path), m); err != nil {
		t.Fatal(err)
	}
	s := openForTest(t, path)
	got, _ := s.Overrides()
	if len(got) != 3 || len(s.Notes()) != 1 {
		t.Errorf("Open = %d overrides, notes %q; want the mirror's 3 and a note", len(got), s.Notes())
	}
}

// TestMirrorFollowsEveryChange: the mirror holds what the database holds
// after every kind of change.
func TestMirrorFollowsEveryChange(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s := openForTest(t, path)
	check := func(what string) {
		t.Helper()
		m, ok, err := readMirror(mirrorPath(path))
		cur, _ := s.Overrides()
		if err != nil || !ok || !sameOverrides(m.Overrides, cur) {
			t.Errorf("after %s: mirror %+v (%v, %v), database %+v", what, m.Overrides, ok, err, cur)
		}
	}
	check("open")
	for _, o := range policyForTest {
		if _, _, err := s.Put(o); err != nil {
			t.Fatal(err)
		}
	}
	check("put")
	if _, _, err := s.Delete(policyForTest[1].Key()); err != nil {
		t.Fatal(err)
	}
	check("delete")
	if _, err := s.Reset(Filter{}); err != nil {
		t.Fatal(err)
	}
	check("reset")
	if st, err := os.Stat(mirrorPath(path)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("mirror mode = %v, %v; want 0600", st.Mode().Perm(), err)
	}
}
