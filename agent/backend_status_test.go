package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
	"github.com/infermesh/infermesh/store"
)

type admitAll struct{}

func (admitAll) IsAdmitted(string) bool { return true }
func (admitAll) MayServe(string) bool   { return true }
func (admitAll) Trusted(string) bool    { return true }

// TestRouteFollowsThePeerScorer: route ranks candidates as the proxy tries
// them, with a cooled-down peer last and a note saying why.
func TestRouteFollowsThePeerScorer(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	a, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	// A table whose peers are admitted, and the proxy's scorer over it, as
	// Run builds them with a mesh.
	if a.table, err = placement.New(placement.Config{NodeID: "a", Admission: admitAll{}}); err != nil {
		t.Fatal(err)
	}
	if a.scorer, err = proxy.NewPeerScorer(a.table, proxy.PeerScoreConfig{Cooldown: time.Hour}); err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(filepath.Join(dir, store.FileName), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	b, err := NewBackend(a, st, AdminOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for node, load := range map[string]uint32{"b": 0, "c": 5} {
		if err := a.table.IngestAdvertisement(node, placement.Advert{Name: "infer.chat", Node: node, Load: load}); err != nil {
			t.Fatal(err)
		}
	}
	ranks := func() string {
		rt, err := b.Route(context.Background(), "chat")
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, d := range rt.Decisions {
			out = append(out, fmt.Sprintf("%s:%d:%s", d.Node, d.Rank, strings.Join(d.Notes, ",")))
		}
		return rt.Serving + " " + strings.Join(out, " ")
	}
	if got, want := ranks(), "b b:0: c:1: a:-1:"; got != want {
		t.Errorf("route before failures = %q, want %q", got, want)
	}
	for range 3 {
		a.scorer.Observe("b", false)
	}
	got := ranks()
	if !strings.HasPrefix(got, "c c:0: b:1:cooled down until ") || !strings.Contains(got, "after 3 failure(s): tried last a:-1:") {
		t.Errorf("route with b cooled down = %q, want c first and b last with a note", got)
	}
}
