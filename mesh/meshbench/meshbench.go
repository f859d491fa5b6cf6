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
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"

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
func Measure(ctx context.Context, n int, tune func(*mesh.Config)) (res Result, err error) {
	c, err := NewCluster(n, tune, nil)
	if err != nil {
		return Result{}, err
	}
	defer func() {
		if cerr := c.Close(); err == nil {
			err = cerr
		}
	}()
	res = Result{N: n, Config: c.Config}
	if res.Membership, err = c.Form(ctx); err != nil {
		return res, err
	}
	if res.Advert, err = c.Advertise(ctx); err != nil {
		return res, err
	}
	res.Refusals = c.Refusals()
	res.Death, err = c.KillOrigin(ctx)
	return res, err
}

// Role is the role the origin (node 0) advertises and every other node
// accepts from it.
const Role = "bench"

// Cluster is n in-process meshes, node i named n<i>, admitted by one
// authority's certificates; node 0 is the origin of the measured advert.
type Cluster struct {
	// Config is the mesh configuration of every node (node-specific fields
	// zeroed).
	Config mesh.Config
	Meshes []*mesh.Mesh
	Tables []*placement.Table
	// Logf, when set, hears progress while Form waits (every 5 s).
	Logf func(format string, args ...any)
	dir  string
}

// NewCluster starts n meshes with mesh.DefaultConfig adjusted by tune (may
// be nil). transport, when not nil, gives node i its gossip transport
// (mesh.Config.Transport); nil means real sockets on 127.0.0.1. They have
// not joined yet (Form). Close releases everything.
func NewCluster(n int, tune func(*mesh.Config), transport func(i int) memberlist.Transport) (_ *Cluster, err error) {
	if n < 2 {
		return nil, errors.New("meshbench: need at least 2 nodes")
	}
	dir, err := os.MkdirTemp("", "meshbench")
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, Meshes: make([]*mesh.Mesh, n), Tables: make([]*placement.Table, n)}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	keyring := filepath.Join(dir, "keyring.json")
	if _, err := identity.WriteNewKeyring(keyring); err != nil {
		return nil, err
	}
	apub, apriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	base := mesh.DefaultConfig()
	base.Cluster = "bench"
	base.BindAddr = "127.0.0.1:0"
	base.KeyringPath = keyring
	base.Trust = mesh.TrustConfig{Authorities: []ed25519.PublicKey{apub}}
	if tune != nil {
		tune(&base)
	}
	c.Config = base
	c.Config.NodeName, c.Config.Trust = "", mesh.TrustConfig{}

	origin := c.Origin()
	for i := range n {
		cfg := base
		cfg.NodeName = fmt.Sprintf("n%d", i)
		cfg.StateDir = filepath.Join(dir, cfg.NodeName)
		if transport != nil {
			cfg.Transport = transport(i)
		}
		key, _, err := identity.LoadOrCreateKey(filepath.Join(cfg.StateDir, identity.NodeKeyFile))
		if err != nil {
			return nil, err
		}
		cert, err := identity.IssueCertificate(apriv, cfg.NodeName, key.Public().(ed25519.PublicKey), identity.ScopeFull, time.Hour, time.Now())
		if err != nil {
			return nil, err
		}
		cfg.Certificate = cert.String()
		adm := &mesh.AdmissionProxy{}
		tab, err := placement.New(placement.Config{NodeID: cfg.NodeName, Admission: adm, AdvertTTL: cfg.AdvertTTL})
		if err != nil {
			return nil, err
		}
		tab.AllowRemoteNode(Role, origin, true)
		cfg.Sink = tab
		m, err := mesh.New(cfg)
		if err != nil {
			return nil, err
		}
		adm.Bind(m)
		c.Meshes[i], c.Tables[i] = m, tab
	}
	return c, nil
}

// Origin is the name of node 0.
func (c *Cluster) Origin() string { return "n0" }

// Form joins node i to node i/2 (a fleet started in waves), in order, and
// returns the time from the first join until every node lists every other.
func (c *Cluster) Form(ctx context.Context) (time.Duration, error) {
	n := len(c.Meshes)
	start := time.Now()
	for i := 1; i < n; i++ {
		to := c.Meshes[i/2].GossipAddr()
		if _, err := c.Meshes[i].JoinAddrs(ctx, []string{to}); err != nil {
			return 0, fmt.Errorf("n%d join: %w", i, err)
		}
	}
	if c.Logf != nil {
		c.Logf("joined: %d nodes in %v", n, time.Since(start).Round(time.Millisecond))
		done := make(chan struct{})
		defer close(done)
		go func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for {
				select {
				case <-done:
					return
				case <-t.C:
				}
				missing, least := 0, n
				for _, m := range c.Meshes {
					k := len(m.Members())
					least = min(least, k)
					missing += n - k
				}
				c.Logf("forming for %v: %d memberships missing, least %d of %d", time.Since(start).Round(time.Millisecond), missing, least, n)
			}
		}()
	}
	if err := waitAll(ctx, n, func(i int) bool { return len(c.Meshes[i].Members()) == n }); err != nil {
		return 0, fmt.Errorf("membership: %w", err)
	}
	return time.Since(start), nil
}

// Advertise has the origin start serving Role and returns the time until
// every other node resolves it there (including up to one gossip interval
// before the origin notices the new role).
func (c *Cluster) Advertise(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	if err := c.Tables[0].RegisterLocal(Role, placement.Local{Base: "http://127.0.0.1:9", API: "openai", Runtime: "bench"}); err != nil {
		return 0, err
	}
	c.Tables[0].ExposeToMesh(Role, true)
	if err := waitAll(ctx, len(c.Meshes), func(i int) bool { return i == 0 || c.resolves(i) }); err != nil {
		return 0, fmt.Errorf("advert: %w", err)
	}
	return time.Since(start), nil
}

// KillOrigin closes the origin without leaving and returns the time until
// no node resolves its role any more.
func (c *Cluster) KillOrigin(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	c.Meshes[0].Close()
	if err := waitAll(ctx, len(c.Meshes), func(i int) bool { return i == 0 || !c.resolves(i) }); err != nil {
		return 0, fmt.Errorf("death: %w", err)
	}
	return time.Since(start), nil
}

func (c *Cluster) resolves(i int) bool {
	for _, cand := range c.Tables[i].Resolve(Role) {
		if cand.Kind == placement.KindRemote && cand.Node == c.Origin() {
			return true
		}
	}
	return false
}

// Refusals sums every node's refusal counters (unknown_origin means nodes
// had wrongly declared the origin dead: an overloaded host).
func (c *Cluster) Refusals() map[string]uint64 {
	sum := map[string]uint64{}
	for _, m := range c.Meshes {
		if m == nil {
			continue
		}
		for k, v := range m.Refusals() {
			sum[k] += v
		}
	}
	return sum
}

// Close closes every mesh, then waits for memberlist's own goroutines to
// end: Shutdown does not wait for a probe in flight, which lasts up to the
// probe interval scaled by memberlist's awareness (8x on an overloaded
// host), nor for the handler of a stream it accepted (TCPTimeout), and
// they would otherwise outlive the cluster (goleak saw about 25 probeNode
// goroutines after a run under load). The wait returns as soon as they are
// gone; its bound is twice theirs plus 30 s, for a host so loaded that a
// goroutine waits seconds to run. It is an error if they outlive it.
func (c *Cluster) Close() error {
	var wg sync.WaitGroup
	for _, m := range c.Meshes {
		if m != nil {
			wg.Go(func() { m.Close() })
		}
	}
	wg.Wait()
	os.RemoveAll(c.dir)
	bound := 2*(8*c.Config.ProbeInterval+c.Config.TCPTimeout) + 30*time.Second
	return waitMemberlistIdle(bound)
}

// waitMemberlistIdle polls the goroutine dump until no memberlist
// goroutine is left, for at most d. It looks at the whole process: callers
// must not run other memberlists at the same time.
func waitMemberlistIdle(d time.Duration) error {
	deadline := time.Now().Add(d)
	buf := make([]byte, 1<<20)
	for {
		for {
			n := runtime.Stack(buf, true)
			if n < len(buf) {
				buf = buf[:n]
				break
			}
			buf = make([]byte, 2*len(buf))
		}
		if !bytes.Contains(buf, []byte("github.com/hashicorp/memberlist.")) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("meshbench: memberlist goroutines still running %v after close", d)
		}
		buf = buf[:cap(buf)]
		time.Sleep(20 * time.Millisecond)
	}
}

// waitAll polls until cond holds for every node index, or ctx ends.
func waitAll(ctx context.Context, n int, cond func(i int) bool) error {
	done := make([]bool, n)
	left := n
	t := time.NewTicker(10 * time.Millisecond)
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
