package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/metrics"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
	"github.com/infermesh/infermesh/store"
)

func TestSecondAgentRefused(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	first := startAdminAgent(t, cfg, AdminOptions{})

	runOnce := func(cfg *Config, opts Options) error {
		a, err := New(cfg, opts)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return a.Run(ctx)
	}
	// A second agent on the same config refuses to start: a live agent
	// answers on the socket.
	if err := runOnce(cfg, Options{}); !errors.Is(err, admin.ErrInUse) {
		t.Fatalf("a second agent on a live socket: Run = %v, want ErrInUse", err)
	}
	if _, err := first.client.Status(context.Background()); err != nil {
		t.Errorf("the first agent stopped answering: %v", err)
	}
	// Another socket but the same state dir: the store is locked.
	other := *cfg
	other.Admin.Socket = filepath.Join(dir, "other.sock")
	err := runOnce(&other, Options{AdminTuning: func(o *AdminOptions) { o.StoreLockTimeout = 50 * time.Millisecond }})
	if !errors.Is(err, store.ErrLocked) {
		t.Fatalf("a second agent on the same state dir: Run = %v, want store.ErrLocked", err)
	}
	if _, err := os.Stat(other.Admin.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused agent left its socket behind: %v", err)
	}
}

// TestStaleSocketReplacedAtStart: a socket file left by a crashed agent
// does not stop the next one.
func TestStaleSocketReplacedAtStart(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: cfg.Admin.Socket, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	_ = ln.Close()
	aa := startAdminAgent(t, cfg, AdminOptions{})
	if _, err := aa.client.Status(context.Background()); err != nil {
		t.Errorf("Status over the replaced socket: %v", err)
	}
}

func TestEventsAndMetricsOnTheSocket(t *testing.T) {
	dir := t.TempDir()
	cfg := adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1"))
	cfg.Admin.Metrics = fmt.Sprintf("127.0.0.1:%d", testnet.TCPPort(t, "127.0.0.1"))
	m, err := metrics.New(metrics.Config{Version: Version})
	if err != nil {
		t.Fatal(err)
	}
	aa := startAdminAgent(t, cfg, AdminOptions{Metrics: m, Mesh: newFakeMesh()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	events := make(chan admin.Event, 64)
	done := make(chan error, 1)
	go func() {
		done <- aa.client.Events(ctx, admin.EventsOptions{Follow: true}, func(e admin.Event) error { events <- e; return nil })
	}()
	if _, err := aa.client.SetPolicy(context.Background(), admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: "chat", Node: "z", On: true}); err != nil {
		t.Fatal(err)
	}
	var kinds []string
	deadline := time.After(10 * time.Second)
	for !slices.Contains(kinds, AuditAdminPolicy) {
		select {
		case e := <-events:
			kinds = append(kinds, e.Kind)
		case <-deadline:
			t.Fatalf("no %s event; got %v", AuditAdminPolicy, kinds)
		}
	}
	if !slices.Contains(kinds, "infer.remote.allow") {
		t.Errorf("events %v lack the placement change infer.remote.allow", kinds)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Events after cancel = %v, want nil", err)
	}

	// A refused advert (this table has no admission: no mesh) is counted.
	_ = aa.a.Table().IngestAdvertisement("b", placement.Advert{Name: "infer.chat", Node: "b"})
	wantRefusal := `infermesh_refusals_total{reason="no mesh (no admission configured)"} 1`
	var text string
	waitFor(t, "the refusal counted", func() bool {
		var err error
		text, err = aa.client.Metrics(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains(text, wantRefusal)
	})
	for _, want := range []string{"infermesh_build_info", `infermesh_peers{state="admitted"} 1`, `infermesh_mesh_refusals_total{reason="bad_signature"} 2`} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics on the socket lacks %q", want)
		}
	}
	addr, ok := aa.ad.MetricsAddr()
	if !ok {
		t.Fatal("no metrics listener")
	}
	resp, err := http.Get("http://" + addr.String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "infermesh_build_info") {
		t.Errorf("GET /metrics on %s = %d", addr, resp.StatusCode)
	}
	// Liveness and readiness on the metrics listener: ready means every
	// role has a candidate.
	resp, err = http.Get("http://" + addr.String() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("GET /health = %d, want 200", resp.StatusCode)
	}
	resp, err = http.Get("http://" + addr.String() + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	var rd proxy.Readiness
	err = json.NewDecoder(resp.Body).Decode(&rd)
	resp.Body.Close()
	cands := len(aa.a.Table().Resolve("chat"))
	if err != nil || rd.Candidates["chat"] != cands || rd.Ready != (cands > 0) || (resp.StatusCode == 200) != rd.Ready {
		t.Errorf("GET /ready = %d %+v (%v); chat has %d candidates", resp.StatusCode, rd, err, cands)
	}
}

func TestRefusalReason(t *testing.T) {
	tests := []struct {
		e      Event
		reason string
		ok     bool
	}{
		{Event{Kind: placement.AuditPeerRefused, Fields: map[string]string{"why": "peer not on the role's serve list"}}, "peer not on the role's serve list", true},
		// Counted where it happens (its audit is rate-limited), not from the stream.
		{Event{Kind: AuditAdminRefused, Fields: map[string]string{"why": "uid 1000 may only read"}}, "", false},
		{Event{Kind: mesh.AuditNodeRefused, Fields: map[string]string{"why": "unadmitted_node"}}, "", false},
		{Event{Kind: placement.AuditRemoteAllow}, "", false},
		{Event{Kind: "x.refused"}, "x.refused", true},
	}
	for _, tt := range tests {
		if got, ok := refusalReason(tt.e); got != tt.reason || ok != tt.ok {
			t.Errorf("refusalReason(%s) = %q, %v; want %q, %v", tt.e.Kind, got, ok, tt.reason, tt.ok)
		}
	}
}
