package store

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.etcd.io/bbolt"
)

func TestBucketNamesFollowTheRule(t *testing.T) {
	rule := regexp.MustCompile(`^[a-z]+\.[a-z_]+\.v[1-9][0-9]*$`)
	seen := map[string]string{}
	for _, id := range Buckets() {
		if !rule.MatchString(id.Name()) {
			t.Errorf("bucket %q does not follow <owner>.<name>.v<N>", id.Name())
		}
		for _, n := range append([]string{id.Name()}, id.Legacy()...) {
			if other, ok := seen[n]; ok {
				t.Errorf("name %q is both %s's and %s's", n, other, id.Name())
			}
			seen[n] = id.Name()
		}
	}
}

func TestOpenBucketRefusesWhatIsNotOthers(t *testing.T) {
	s := openForTest(t, filepath.Join(t.TempDir(), FileName))
	for _, id := range []BucketID{{}, {owner: "x", name: "y", version: 1}, bucketOverrides, bucketMeta} {
		if _, err := OpenBucket[string](s, id); err == nil {
			t.Errorf("OpenBucket(%q) succeeded, want a refusal", id.Name())
		}
	}
	if _, err := OpenBucket[string](nil, MeshPeers); err == nil {
		t.Errorf("OpenBucket(nil store) succeeded")
	}
}

func TestBucketRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s := openForTest(t, path)
	type rec struct{ N int }
	b, err := OpenBucket[rec](s, NodeIntents)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok, err := b.Get("a"); ok || err != nil || v != (rec{}) {
		t.Errorf("Get(missing) = %+v, %v, %v; want zero, false, nil", v, ok, err)
	}
	for _, k := range []string{"c", "a", "b"} {
		if err := b.Put(k, rec{int(k[0])}); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Put("", rec{}); err == nil {
		t.Errorf("Put with an empty key succeeded")
	}
	if err := b.Delete("b"); err != nil {
		t.Fatal(err)
	}
	if err := b.Delete("never-there"); err != nil {
		t.Errorf("Delete(missing) = %v, want nil", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = openForTest(t, path)
	b, _ = OpenBucket[rec](s, NodeIntents)
	var keys []string
	if err := b.ForEach(func(k string, v rec) error {
		if v.N != int(k[0]) {
			t.Errorf("record %q = %+v", k, v)
		}
		keys = append(keys, k)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if want := []string{"a", "c"}; !slices.Equal(keys, want) {
		t.Errorf("ForEach after reopen walked %v, want %v", keys, want)
	}
	if n, err := b.Len(); n != 2 || err != nil {
		t.Errorf("Len = %d, %v; want 2", n, err)
	}
	stop := errors.New("stop")
	if err := b.ForEach(func(string, rec) error { return stop }); err != stop {
		t.Errorf("ForEach returned %v, want fn's error", err)
	}
	// A record that does not decode is named.
	if err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(NodeIntents.key()).Put([]byte("broken"), []byte("{"))
	}); err != nil {
		t.Fatal(err)
	}
	if err := b.ForEach(func(string, rec) error { return nil }); err == nil || !strings.Contains(err.Error(), `"broken"`) {
		t.Errorf("ForEach over a damaged record = %v, want an error naming it", err)
	}
	if _, _, err := b.Get("broken"); err == nil || !strings.Contains(err.Error(), `"broken"`) {
		t.Errorf("Get of a damaged record = %v, want an error naming it", err)
	}
}

// previousRelease writes a state store as the releases before the naming
// rule did: every bucket under its former name, the policy at generation
// gen, and its mirror.
func previousRelease(t *testing.T, path string, gen uint64, o Override, values map[string]string) {
	t.Helper()
	db, err := bbolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bbolt.Tx) error {
		put := func(bucket string, k, v []byte) error {
			b, err := tx.CreateBucketIfNotExists([]byte(bucket))
			if err != nil {
				return err
			}
			return b.Put(k, v)
		}
		if err := put("policy_overrides.v1", o.Key().bytes(), mustJSON(t, o)); err != nil {
			return err
		}
		if err := put("store_meta.v1", keyGeneration, []byte(strconv.FormatUint(gen, 10))); err != nil {
			return err
		}
		for bucket, v := range values {
			if err := put(bucket, []byte("k"), []byte(v)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	if err := writeMirror(mirrorPath(path), mirror{Generation: gen, Overrides: []Override{o}}); err != nil {
		t.Fatal(err)
	}
}

func TestPreviousReleaseStoreKeepsEverything(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	o := Override{Kind: KindRevoke, Node: "evil", On: true, At: at, By: "uid 0"}
	values := map[string]string{
		"mesh_peers.v1":     `["peers"]`,
		"mesh_seqs.v1":      `["seqs"]`,
		"audit.v1":          `["audit"]`,
		"provision.intents": `["instance"]`,
		"node.intents":      `["node"]`,
	}
	previousRelease(t, path, 3, o, values)

	s := openForTest(t, path)
	if n := s.Notes(); len(n) != 0 {
		t.Errorf("Notes = %q, want none: nothing was damaged", n)
	}
	if got, err := s.Overrides(); err != nil || !reflect.DeepEqual(got, []Override{o}) {
		t.Errorf("Overrides = %+v, %v; want the previous release's %+v", got, err, o)
	}
	for _, id := range []BucketID{MeshPeers, MeshSeqs, AgentAudit, ProvisionIntents, NodeIntents} {
		b, err := OpenBucket[[]string](s, id)
		if err != nil {
			t.Fatal(err)
		}
		got, ok, err := b.Get("k")
		if want := mustUnmarshal[[]string](t, values[id.legacy[0]]); !ok || err != nil || !slices.Equal(got, want) {
			t.Errorf("%s: Get = %q, %v, %v; want %q from %s", id.Name(), got, ok, err, want, id.legacy[0])
		}
	}
	var names []string
	if err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.ForEach(func(name []byte, _ *bbolt.Bucket) error {
			names = append(names, string(name))
			return nil
		})
	}); err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, id := range Buckets() {
		want = append(want, id.Name())
	}
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Errorf("buckets after Open = %q, want only the registry's %q", names, want)
	}

	// The generation came along: the next change is the fourth, and the
	// store opens again against its mirror.
	if _, _, err := s.Put(Override{Kind: KindExpose, Role: "chat", On: true, At: at}); err != nil {
		t.Fatal(err)
	}
	if m, _, err := readMirror(s.MirrorPath()); err != nil || m.Generation != 4 || len(m.Overrides) != 2 {
		t.Errorf("mirror after a change = generation %d, %d overrides, %v; want 4, 2", m.Generation, len(m.Overrides), err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = openForTest(t, path)
	if got, err := s.Overrides(); err != nil || len(got) != 2 {
		t.Errorf("Overrides after reopen = %+v, %v; want 2", got, err)
	}
}

// A release that knew only the former name ran on the file after this one:
// its bucket is the newest, and replaces the one under the new name.
func TestFormerNameWrittenLaterWins(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	s := openForTest(t, path)
	b, _ := OpenBucket[string](s, MeshPeers)
	if err := b.Put("k", "new code's"); err != nil {
		t.Fatal(err)
	}
	if err := b.Put("only-new", "x"); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bbolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bbolt.Tx) error {
		b, err := tx.CreateBucket([]byte("mesh_peers.v1"))
		if err != nil {
			return err
		}
		return b.Put([]byte("k"), []byte(`"older release's"`))
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	s = openForTest(t, path)
	b, _ = OpenBucket[string](s, MeshPeers)
	if v, _, err := b.Get("k"); v != "older release's" || err != nil {
		t.Errorf("Get(k) = %q, %v; want the older release's later write", v, err)
	}
	if n, _ := b.Len(); n != 1 {
		t.Errorf("%d records, want only the older release's 1", n)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustUnmarshal[T any](t *testing.T, s string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatal(err)
	}
	return v
}
