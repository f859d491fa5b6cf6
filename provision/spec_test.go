package provision

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"go.etcd.io/bbolt"
)

func TestSpecJSONRoundTripKeepsReadOnlyIntent(t *testing.T) {
	stage := uint32(2)
	spec := NodeSpec{
		RunID: 17, NodeID: 23, AttemptID: 7, StageIndex: &stage,
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
	if !strings.Contains(string(b), `"env":[["A","B"]]`) {
		t.Errorf("json = %s, want env as [name, value] pairs", b)
	}
	var got NodeSpec
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, spec) {
		t.Errorf("round trip = %+v, want %+v", got, spec)
	}
}

func TestSpecOlderJSONDecodesWithDefaults(t *testing.T) {
	var got NodeSpec
	err := json.Unmarshal([]byte(`{"run_id":17,"node_id":23,"stage_index":2,"image":"runtime:latest","env":[],"args":[]}`), &got)
	if err != nil {
		t.Fatal(err)
	}
	if got.AttemptID != 0 || len(got.Mounts) != 0 || got.Role != "" || len(got.Ports) != 0 {
		t.Errorf("legacy spec = %+v, want zero attempt, no mounts, role or ports", got)
	}
	if got.StageIndex == nil || *got.StageIndex != 2 || got.RunID != 17 || got.NodeID != 23 {
		t.Errorf("legacy spec = %+v, want run 17 node 23 stage 2", got)
	}
	if err := json.Unmarshal([]byte(`{"env":[["A","B","C"]]}`), &got); err == nil {
		t.Errorf("three-element env pair decoded without error")
	}
}

func TestSpecHashCoversContentNotIdentity(t *testing.T) {
	base := demoSpec("chat", 1)
	stage := uint32(9)
	tests := []struct {
		name   string
		mutate func(*NodeSpec)
		same   bool
	}{
		{"attempt", func(s *NodeSpec) { s.AttemptID = 2 }, true},
		{"run and node", func(s *NodeSpec) { s.RunID, s.NodeID = 5, 6 }, true},
		{"stage", func(s *NodeSpec) { s.StageIndex = &stage }, true},
		{"image", func(s *NodeSpec) { s.Image = "other:1" }, false},
		{"env", func(s *NodeSpec) { s.Env = []EnvVar{{Name: "INFERMESH_TEST", Value: "2"}} }, false},
		{"args", func(s *NodeSpec) { s.Args = append(s.Args, "-x") }, false},
		{"mount read-only flag", func(s *NodeSpec) { s.Mounts = []Mount{{HostPath: "/a", ContainerPath: "/b", ReadOnly: true}} }, false},
		{"ports", func(s *NodeSpec) { s.Ports = []int{9090} }, false},
		{"role", func(s *NodeSpec) { s.Role = "embed" }, false},
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
		mutate  func(*NodeSpec)
		wantErr string
	}{
		{"valid", func(*NodeSpec) {}, ""},
		{"template", func(s *NodeSpec) { s.AttemptID = 0 }, "unbound template"},
		{"no image", func(s *NodeSpec) { s.Image = " " }, "image"},
		{"env name", func(s *NodeSpec) { s.Env = []EnvVar{{Name: "A=B"}} }, "env[0]"},
		{"relative host path", func(s *NodeSpec) { s.Mounts = []Mount{{HostPath: "models", ContainerPath: "/m"}} }, "mounts[0]"},
		{"relative container path", func(s *NodeSpec) { s.Mounts = []Mount{{HostPath: "/m", ContainerPath: "m"}} }, "mounts[0]"},
		{"port", func(s *NodeSpec) { s.Ports = []int{0} }, "ports[0]"},
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
	want := Observation{Kind: ObsProvider, RunID: 1, NodeID: 2, Line: "booting"}
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

func (p *minimalProvider) CreateNode(context.Context, NodeSpec, Sink) (NodeHandle, error) {
	p.created++
	return NodeHandle{Ref: "x"}, nil
}
func (p *minimalProvider) CreateNodeSelected(ctx context.Context, s NodeSpec, k Sink, offer *uint64) (NodeHandle, error) {
	return CreateNodeSelectedDefault(ctx, p, s, k, offer)
}
func (p *minimalProvider) StartBootstrap(context.Context, NodeHandle) error    { return nil }
func (p *minimalProvider) CompleteBootstrap(context.Context, NodeHandle) error { return nil }
func (p *minimalProvider) StopNode(context.Context, NodeHandle) error          { return nil }

var _ Provider = (*minimalProvider)(nil)

func TestProviderDefaults(t *testing.T) {
	ctx := context.Background()
	p := &minimalProvider{}
	spec := NodeSpec{RunID: 17, NodeID: 23, AttemptID: 1, Image: "i"}
	offer := uint64(99)
	if _, err := p.CreateNodeSelected(ctx, spec, Discard, &offer); !errors.Is(err, ErrOfferUnsupported) || !strings.Contains(err.Error(), "99") {
		t.Errorf("CreateNodeSelected(offer) = %v, want ErrOfferUnsupported naming the offer", err)
	}
	if p.created != 0 {
		t.Errorf("an exact offer it cannot honour was substituted by CreateNode")
	}
	if _, err := p.CreateNodeSelected(ctx, spec, Discard, nil); err != nil || p.created != 1 {
		t.Errorf("CreateNodeSelected(nil) = %v, created %d, want CreateNode", err, p.created)
	}
	if got, want := p.ProviderRef(spec), "node-17-23"; got != want {
		t.Errorf("ProviderRef = %q, want %q", got, want)
	}
	if _, ok, err := p.AdoptBySpec(ctx, spec, Discard); ok || err != nil {
		t.Errorf("AdoptBySpec = %v, %v", ok, err)
	}
	if _, ok, err := p.PrepareMissingBootstrap(ctx, spec, Discard); ok || err != nil {
		t.Errorf("PrepareMissingBootstrap = %v, %v", ok, err)
	}
	if refs, err := p.ListManagedRefs(ctx); refs != nil || err != nil {
		t.Errorf("ListManagedRefs = %v, %v", refs, err)
	}
	if found, err := p.StopBySpec(ctx, spec, Discard); found || err != nil {
		t.Errorf("StopBySpec = %v, %v, want false, nil", found, err)
	}
	if err := p.CancelBootstrap(ctx, NodeHandle{}); err != nil {
		t.Errorf("CancelBootstrap = %v", err)
	}
}

func TestBoltIntentsDurable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	open := func() (*bbolt.DB, *BoltIntents) {
		db, err := bbolt.Open(path, 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		in, err := NewBoltIntents(db, "provision")
		if err != nil {
			t.Fatal(err)
		}
		return db, in
	}
	db, in := open()
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
	db.Close()

	db, in = open()
	defer db.Close()
	got, err := in.Intents()
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]NodeSpec{"ref-a": a}; !reflect.DeepEqual(got, want) {
		t.Errorf("Intents after reopen = %+v, want %+v", got, want)
	}
	if err := db.Update(func(tx *bbolt.Tx) error { return tx.Bucket([]byte("provision")).Put([]byte("bad"), []byte("{")) }); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Intents(); err == nil || !strings.Contains(err.Error(), "bad") {
		t.Errorf("Intents with a corrupt entry = %v, want an error naming it", err)
	}
	if _, err := NewBoltIntents(nil, "x"); err == nil {
		t.Errorf("NewBoltIntents(nil) succeeded")
	}
	if _, err := NewBoltIntents(db, ""); err == nil {
		t.Errorf("NewBoltIntents(empty bucket) succeeded")
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
