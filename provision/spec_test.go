package provision

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"go.etcd.io/bbolt"

	"github.com/infermesh/infermesh/store"
)

func TestSpecJSONRoundTripKeepsReadOnlyIntent(t *testing.T) {
	spec := ProvisionSpec{
		RunID: 17, InstanceID: 23, AttemptID: 7,
		Image:  "runtime:latest",
		Env:    []EnvVar{{Name: "A", Value: "B"}},
		Args:   []string{"--join"},
		Mounts: []Mount{{HostPath: "/cache/model.gguf", ContainerPath: "/models/model.gguf", ReadOnly: true}},
		Role:   "chat",
		Ports:  []int{8080},
	}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"env":[["A","B"]]`, `"instance_id":23`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("json = %s, want it to contain %s", b, want)
		}
	}
	var got ProvisionSpec
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, spec) {
		t.Errorf("round trip = %+v, want %+v", got, spec)
	}
}

// Intents the previous release wrote to the state store, byte for byte:
// the instance id was "node_id" and every spec carried "stage_index".
const (
	legacyIntentFull = `{"run_id":17,"node_id":23,"attempt_id":7,"stage_index":2,"image":"runtime:latest","env":[["A","B"]],"args":["--port","8080"],"mounts":[{"host_path":"/cache/model.gguf","container_path":"/models/model.gguf","readonly":true}],"role":"chat","ports":[8080]}`
	legacyIntentRole = `{"run_id":0,"node_id":17483973832482698379,"attempt_id":3,"stage_index":null,"image":"llama-server:local","env":[["A","1"],["B","2"]],"args":["--port","8080"],"role":"chat","ports":[8080]}`
)

func TestSpecOlderJSONDecodes(t *testing.T) {
	tests := []struct {
		name string
		json string
		want ProvisionSpec
	}{
		{"reference design shape, no mounts, attempt, role or ports",
			`{"run_id":17,"node_id":23,"stage_index":2,"image":"runtime:latest","env":[],"args":[]}`,
			ProvisionSpec{RunID: 17, InstanceID: 23, Image: "runtime:latest", Env: []EnvVar{}, Args: []string{}}},
		{"previous release, every field", legacyIntentFull,
			ProvisionSpec{RunID: 17, InstanceID: 23, AttemptID: 7, Image: "runtime:latest",
				Env: []EnvVar{{"A", "B"}}, Args: []string{"--port", "8080"},
				Mounts: []Mount{{HostPath: "/cache/model.gguf", ContainerPath: "/models/model.gguf", ReadOnly: true}},
				Role:   "chat", Ports: []int{8080}}},
		{"previous release, a role's instance", legacyIntentRole,
			InstanceSpec{Image: "llama-server:local", Args: []string{"--port", "8080"}, Env: map[string]string{"B": "2", "A": "1"}, Port: 8080}.provisionSpec("chat", 3)},
		{"instance_id wins over node_id", `{"instance_id":5,"node_id":6,"attempt_id":1}`,
			ProvisionSpec{InstanceID: 5, AttemptID: 1}},
		{"instance_id 0 is not replaced by node_id", `{"instance_id":0,"node_id":6}`, ProvisionSpec{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got ProvisionSpec
			if err := json.Unmarshal([]byte(tt.json), &got); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("decode(%s) = %+v, want %+v", tt.json, got, tt.want)
			}
		})
	}
	var got ProvisionSpec
	if err := json.Unmarshal([]byte(`{"env":[["A","B","C"]]}`), &got); err == nil {
		t.Errorf("three-element env pair decoded without error")
	}
	if err := json.Unmarshal([]byte(`{"node_id":"x"}`), &got); err == nil {
		t.Errorf("a string node_id decoded without error")
	}
}

// The spec hash and the container name are in the labels and names of
// containers the previous release created: they must not change, or an
// upgraded agent would replace every running container instead of
// adopting it.
func TestSpecHashAndNameAreStableAcrossReleases(t *testing.T) {
	var full, role ProvisionSpec
	if err := json.Unmarshal([]byte(legacyIntentFull), &full); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(legacyIntentRole), &role); err != nil {
		t.Fatal(err)
	}
	if got, want := full.Hash(), "687f870b87ad8d6f"; got != want {
		t.Errorf("hash of the previous release's spec = %s, want %s", got, want)
	}
	if got, want := role.Hash(), "ca666038e40292fd"; got != want {
		t.Errorf("hash of the previous release's role spec = %s, want %s", got, want)
	}
	if got, want := resourceName("default", "a", role), "infermesh-default-a-chat-3"; got != want {
		t.Errorf("container name = %s, want %s", got, want)
	}
}

func TestSpecHashCoversContentNotIdentity(t *testing.T) {
	base := demoSpec("chat", 1)
	tests := []struct {
		name   string
		mutate func(*ProvisionSpec)
		same   bool
	}{
		{"attempt", func(s *ProvisionSpec) { s.AttemptID = 2 }, true},
		{"run and instance", func(s *ProvisionSpec) { s.RunID, s.InstanceID = 5, 6 }, true},
		{"image", func(s *ProvisionSpec) { s.Image = "other:1" }, false},
		{"env", func(s *ProvisionSpec) { s.Env = []EnvVar{{Name: "INFERMESH_TEST", Value: "2"}} }, false},
		{"args", func(s *ProvisionSpec) { s.Args = append(s.Args, "-x") }, false},
		{"mount read-only flag", func(s *ProvisionSpec) { s.Mounts = []Mount{{HostPath: "/a", ContainerPath: "/b", ReadOnly: true}} }, false},
		{"ports", func(s *ProvisionSpec) { s.Ports = []int{9090} }, false},
		{"role", func(s *ProvisionSpec) { s.Role = "embed" }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := base.Clone()
			tt.mutate(&s)
			if got := s.Hash() == base.Hash(); got != tt.same {
				t.Errorf("hash equal after changing %s = %v, want %v", tt.name, got, tt.same)
			}
		})
	}
}

func TestSpecValidate(t *testing.T) {
	ok := demoSpec("chat", 1)
	tests := []struct {
		name    string
		mutate  func(*ProvisionSpec)
		wantErr string
	}{
		{"valid", func(*ProvisionSpec) {}, ""},
		{"template", func(s *ProvisionSpec) { s.AttemptID = 0 }, "unbound template"},
		{"no image", func(s *ProvisionSpec) { s.Image = " " }, "image"},
		{"env name", func(s *ProvisionSpec) { s.Env = []EnvVar{{Name: "A=B"}} }, "env[0]"},
		{"relative host path", func(s *ProvisionSpec) { s.Mounts = []Mount{{HostPath: "models", ContainerPath: "/m"}} }, "mounts[0]"},
		{"relative container path", func(s *ProvisionSpec) { s.Mounts = []Mount{{HostPath: "/m", ContainerPath: "m"}} }, "mounts[0]"},
		{"port", func(s *ProvisionSpec) { s.Ports = []int{0} }, "ports[0]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ok.Clone()
			tt.mutate(&s)
			err := s.Validate()
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("Validate() = %v, want error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestSinkFuncDeliversTypedObservations(t *testing.T) {
	var mu sync.Mutex
	var got []Observation
	sink := SinkFunc(func(o Observation) {
		mu.Lock()
		got = append(got, o)
		mu.Unlock()
	})
	want := Observation{Kind: ObsProvider, RunID: 1, InstanceID: 2, Line: "booting"}
	sink.Observe(want)
	if len(got) != 1 || !reflect.DeepEqual(got[0], want) {
		t.Errorf("observed %+v, want [%+v]", got, want)
	}
}

// minimalProvider implements only the required parts and embeds the defaults.
type minimalProvider struct {
	ProviderDefaults
	created int
}

func (p *minimalProvider) CreateInstance(context.Context, ProvisionSpec, Sink) (InstanceHandle, error) {
	p.created++
	return InstanceHandle{Ref: "x"}, nil
}
func (p *minimalProvider) StartInstance(context.Context, InstanceHandle) error { return nil }
func (p *minimalProvider) MarkLive(context.Context, InstanceHandle) error      { return nil }

var _ Provider = (*minimalProvider)(nil)

// offerProvider has offers: it creates exactly the selected one.
type offerProvider struct {
	minimalProvider
	selected []uint64
}

func (p *offerProvider) CreateInstanceSelected(ctx context.Context, s ProvisionSpec, k Sink, offer *uint64) (InstanceHandle, error) {
	if offer == nil {
		return p.CreateInstance(ctx, s, k)
	}
	p.selected = append(p.selected, *offer)
	return InstanceHandle{Ref: fmt.Sprintf("offer-%d", *offer)}, nil
}

// CreateSelected goes through a provider's OfferSelector: the selected
// offer is what gets created, never CreateInstance in its place.
func TestCreateSelectedUsesTheOfferSelector(t *testing.T) {
	p := &offerProvider{}
	offer := uint64(7)
	h, err := CreateSelected(context.Background(), p, ProvisionSpec{AttemptID: 1}, Discard, &offer)
	if err != nil || h.Ref != "offer-7" || !reflect.DeepEqual(p.selected, []uint64{7}) || p.created != 0 {
		t.Errorf("CreateSelected(7) = %+v, %v; selected %v, created %d; want offer 7 created exactly", h, err, p.selected, p.created)
	}
}

func TestProviderDefaults(t *testing.T) {
	ctx := context.Background()
	p := &minimalProvider{}
	spec := ProvisionSpec{RunID: 17, InstanceID: 23, AttemptID: 1, Image: "i"}
	offer := uint64(99)
	if _, err := CreateSelected(ctx, p, spec, Discard, &offer); !errors.Is(err, ErrOfferUnsupported) || !strings.Contains(err.Error(), "99") {
		t.Errorf("CreateSelected(offer) = %v, want ErrOfferUnsupported naming the offer", err)
	}
	if p.created != 0 {
		t.Errorf("an exact offer it cannot honour was substituted by CreateInstance")
	}
	if _, err := CreateSelected(ctx, p, spec, Discard, nil); err != nil || p.created != 1 {
		t.Errorf("CreateSelected(nil) = %v, created %d, want CreateInstance", err, p.created)
	}
	if got, want := p.ProviderRef(spec), "instance-17-23"; got != want {
		t.Errorf("ProviderRef = %q, want %q", got, want)
	}
	if _, ok, err := p.AdoptBySpec(ctx, spec, Discard); ok || err != nil {
		t.Errorf("AdoptBySpec = %v, %v", ok, err)
	}
	if _, ok, err := p.PrepareBySpec(ctx, spec, Discard); ok || err != nil {
		t.Errorf("PrepareBySpec = %v, %v", ok, err)
	}
	if refs, err := ManagedRefs(ctx, p); refs != nil || err != nil {
		t.Errorf("ManagedRefs = %v, %v", refs, err)
	}
	if found, err := p.StopBySpec(ctx, spec, Discard); found || err != nil {
		t.Errorf("StopBySpec = %v, %v, want false, nil", found, err)
	}
	if err := p.HaltInstance(ctx, InstanceHandle{}); err != nil {
		t.Errorf("HaltInstance = %v", err)
	}
}

func TestBoltIntentsDurable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	open := func() (*store.Store, *BoltIntents) {
		st, err := store.Open(path, store.Options{})
		if err != nil {
			t.Fatal(err)
		}
		in, err := NewBoltIntents(st)
		if err != nil {
			t.Fatal(err)
		}
		return st, in
	}
	// rawPut writes a value as another release would have, the store
	// closed.
	rawPut := func(key, value string) {
		t.Helper()
		db, err := bbolt.Open(path, 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if err := db.Update(func(tx *bbolt.Tx) error {
			return tx.Bucket([]byte(store.ProvisionIntents.Name())).Put([]byte(key), []byte(value))
		}); err != nil {
			t.Fatal(err)
		}
	}
	st, in := open()
	a, b := demoSpec("a", 1), demoSpec("b", 2)
	if err := in.PutIntent("ref-a", a); err != nil {
		t.Fatal(err)
	}
	if err := in.PutIntent("ref-b", b); err != nil {
		t.Fatal(err)
	}
	if err := in.DeleteIntent("ref-b"); err != nil {
		t.Fatal(err)
	}
	if err := in.DeleteIntent("never-there"); err != nil {
		t.Errorf("DeleteIntent(missing) = %v, want nil", err)
	}
	st.Close()

	st, in = open()
	got, err := in.Intents()
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]ProvisionSpec{"ref-a": a}; !reflect.DeepEqual(got, want) {
		t.Errorf("Intents after reopen = %+v, want %+v", got, want)
	}
	st.Close()
	// An intent the previous release wrote is read, its instance id included.
	rawPut("ref-old", legacyIntentFull)
	st, in = open()
	got, err = in.Intents()
	if err != nil {
		t.Fatal(err)
	}
	if old := got["ref-old"]; old.InstanceID != 23 || old.AttemptID != 7 || old.Role != "chat" || old.Hash() != "687f870b87ad8d6f" {
		t.Errorf("previous release's intent read as %+v, want instance 23, attempt 7, role chat, same hash", old)
	}
	if err := in.DeleteIntent("ref-old"); err != nil {
		t.Fatal(err)
	}
	st.Close()
	rawPut("bad", "{")
	st, in = open()
	defer st.Close()
	if _, err := in.Intents(); err == nil || !strings.Contains(err.Error(), "bad") {
		t.Errorf("Intents with a corrupt entry = %v, want an error naming it", err)
	}
	if _, err := NewBoltIntents(nil); err == nil {
		t.Errorf("NewBoltIntents(nil) succeeded")
	}
}

func TestLogRing(t *testing.T) {
	tests := []struct {
		name  string
		size  int
		add   int
		n     int
		first string
		count int
	}{
		{"empty", 3, 0, 0, "", 0},
		{"partial, all", 3, 2, 0, "0", 2},
		{"wrapped keeps newest", 3, 5, 0, "2", 3},
		{"last n", 3, 5, 2, "3", 2},
		{"n beyond size", 3, 2, 10, "0", 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewLogRing(tt.size)
			for i := 0; i < tt.add; i++ {
				r.Add(LogLine{Line: string(rune('0' + i))})
			}
			got := r.Last(tt.n)
			if len(got) != tt.count {
				t.Fatalf("Last(%d) len = %d, want %d", tt.n, len(got), tt.count)
			}
			if tt.count > 0 && got[0].Line != tt.first {
				t.Errorf("Last(%d)[0] = %q, want %q", tt.n, got[0].Line, tt.first)
			}
			for i := 1; i < len(got); i++ {
				if got[i].Line <= got[i-1].Line {
					t.Errorf("Last(%d) not oldest first: %v", tt.n, got)
				}
			}
		})
	}
}

func TestLineWriter(t *testing.T) {
	var got []string
	w := &lineWriter{emit: func(l string) { got = append(got, l) }}
	w.Write([]byte("one\r\ntw"))
	w.Write([]byte("o\nthree"))
	w.Write([]byte(strings.Repeat("x", maxLineLen+5)))
	w.flush()
	want := []string{"one", "two", "three" + strings.Repeat("x", maxLineLen-5), "xxxxxxxxxx"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("lines = %q, want %q", got, want)
	}
}
