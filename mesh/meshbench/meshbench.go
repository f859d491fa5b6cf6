// Package meshbench measures the mesh in-process on loopback, for the
// benchmarks (bench/loadgen, agent's BenchmarkRemoteHop):
//
//   - convergence with many nodes (Measure): how long an advert takes to
//     reach every node, and how long after a node dies its roles stop
//     resolving everywhere;
//   - the bare HTTP/3 exchange between two mesh transports (BareH3), the
//     floor under the remote hop.
//
// It asserts no speed: callers report what it measures.
package meshbench

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
)

// Result is one measurement.
type Result struct {
	N int
	// Membership is the time from the first join until every node lists
	// every other.
	Membership time.Duration
	// Advert is the time from the origin starting to serve a role until
	// every other node resolves it (includes up to one gossip interval
	// before the origin notices the new role).
	Advert time.Duration
	// Death is the time from the origin dying (no leave) until no node
	// resolves its role any more.
	Death time.Duration
	// Refusals sums every node's refusal counters at the end of the advert
	// phase (unknown_origin there means nodes had wrongly declared the
	// origin dead: an overloaded host).
	Refusals map[string]uint64
	// Config is the mesh configuration used (node-specific fields zeroed).
	Config mesh.Config
}

func (r Result) String() string {
	c := r.Config
	return fmt.Sprintf("N=%d membership=%v advert=%v death=%v refusals=%v (gossip=%v probe=%v/%v suspicion_mult=%d retransmit_mult=%d pushpull=%v ttl=%v)",
		r.N, r.Membership.Round(time.Millisecond), r.Advert.Round(time.Millisecond), r.Death.Round(time.Millisecond), r.Refusals,
		c.GossipInterval, c.ProbeInterval, c.ProbeTimeout, c.SuspicionMult, c.RetransmitMult, c.PushPullInterval, c.AdvertTTL)
}

// MeasureConvergence runs n nodes with the default (LAN) mesh config and
// measures advert and death convergence.
func MeasureConvergence(ctx context.Context, n int) (time.Duration, error) {
	r, err := Measure(ctx, n, nil)
	return r.Advert, err
}

// Measure runs n in-process nodes on 127.0.0.1, the mesh config being
// mesh.DefaultConfig adjusted by tune (may be nil), and measures.
func Measure(ctx context.Context, n int, tune func(*mesh.Config)) (Result, error) {
	if n < 2 {
		return Result{}, errors.New("meshbench: need at least 2 nodes")
	}
	dir, err := os.MkdirTemp("", "meshbench")
	if err != nil {
		return Result{}, err
	}
	defer os.RemoveAll(dir)
	keyring := filepath.Join(dir, "keyring.json")
	if _, err := identity.WriteNewKeyring(keyring); err != nil {
		return Result{}, err
	}
	apub, apriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return Result{}, err
	}
	base := mesh.DefaultConfig()
	base.Cluster = "bench"
	base.BindAddr = "127.0.0.1:0"
	base.KeyringPath = keyring
	base.Trust = mesh.TrustConfig{Authorities: []ed25519.PublicKey{apub}}
	if tune != nil {
		tune(&base)
	}
	res := Result{N: n, Config: base}
	res.Config.NodeName, res.Config.Trust = "", mesh.TrustConfig{}

	const role = "bench"
	origin := "n0"
	meshes := make([]*mesh.Mesh, n)
	tables := make([]*placement.Table, n)
	defer func() {
		var wg sync.WaitGroup
		for _, m := range meshes {
			if m != nil {
				wg.Go(func() { m.Close() })
			}
		}
		wg.Wait()
	}()
	for i := range n {
		cfg := base
		cfg.NodeName = fmt.Sprintf("n%d", i)
		cfg.StateDir = filepath.Join(dir, cfg.NodeName)
		key, _, err := identity.LoadOrCreateKey(filepath.Join(cfg.StateDir, identity.NodeKeyFile))
		if err != nil {
			return res, err
		}
		cert, err := identity.IssueCertificate(apriv, cfg.NodeName, key.Public().(ed25519.PublicKey), identity.ScopeFull, time.Hour, time.Now())
		if err != nil {
			return res, err
		}
		cfg.Certificate = cert.String()
		adm := &mesh.AdmissionProxy{}
		tab, err := placement.New(placement.Config{NodeID: cfg.NodeName, Admission: adm, AdvertTTL: cfg.AdvertTTL})
		if err != nil {
			return res, err
		}
		tab.AllowRemoteNode(role, origin, true)
		cfg.Sink = tab
		m, err := mesh.New(cfg)
		if err != nil {
			return res, err
		}
		adm.Bind(m)
		meshes[i], tables[i] = m, tab
	}

	start := time.Now()
	for i := 1; i < n; i++ {
		// Join a random earlier node, as a fleet started in waves would.
		to := meshes[i/2].GossipAddr()
		if _, err := meshes[i].JoinAddrs(ctx, []string{to}); err != nil {
			return res, fmt.Errorf("n%d join: %w", i, err)
		}
	}
	if err := waitAll(ctx, n, func(i int) bool { return len(meshes[i].Members()) == n }); err != nil {
		return res, fmt.Errorf("membership: %w", err)
	}
	res.Membership = time.Since(start)

	start = time.Now()
	if err := tables[0].RegisterLocal(role, placement.Local{Base: "http://127.0.0.1:9", API: "openai", Runtime: "bench"}); err != nil {
		return res, err
	}
	tables[0].ExposeToMesh(role, true)
	resolves := func(i int) bool {
		for _, c := range tables[i].Resolve(role) {
			if c.Kind == placement.KindRemote && c.Node == origin {
				return true
			}
		}
		return false
	}
	if err := waitAll(ctx, n, func(i int) bool { return i == 0 || resolves(i) }); err != nil {
		return res, fmt.Errorf("advert: %w", err)
	}
	res.Advert = time.Since(start)
	res.Refusals = map[string]uint64{}
	for _, m := range meshes {
		for k, v := range m.Refusals() {
			res.Refusals[k] += v
		}
	}

	start = time.Now()
	meshes[0].Close()
	if err := waitAll(ctx, n, func(i int) bool { return i == 0 || !resolves(i) }); err != nil {
		return res, fmt.Errorf("death: %w", err)
	}
	res.Death = time.Since(start)
	return res, nil
}

// waitAll polls until cond holds for every node index, or ctx ends.
func waitAll(ctx context.Context, n int, cond func(i int) bool) error {
	done := make([]bool, n)
	left := n
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		for i := range n {
			if !done[i] && cond(i) {
				done[i] = true
				left--
			}
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d nodes not there: %w", left, n, ctx.Err())
		case <-t.C:
		}
	}
}
