// Package admintest provides a fake admin.Backend with fixed, deterministic
// answers, for tests of the admin server and of the CLI's output.
package admintest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

// T0 is the fake's fixed clock.
var T0 = time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)

// Fake is an admin.Backend answering from fixed data. Changes are recorded
// (Calls) and reflected in Policy. Safe for concurrent use.
type Fake struct {
	mu        sync.Mutex
	overrides []admin.Override
	calls     []string
	keys      []admin.GossipKey
	sentOnce  sync.Once

	// NoMesh makes the keyring answer ErrNotConfigured.
	NoMesh bool
	// NoInstances makes Instances answer ErrNotConfigured, as an agent
	// without provisioning does.
	NoInstances bool
	// History is sent by Events before it waits for ctx.
	History []admin.Event
	// HistorySent, when set, is closed once Events has sent History.
	HistorySent chan struct{}
	// LogLines feeds FollowInstanceLogs after embed's recent lines;
	// closing it ends the log as an instance that went away does. Nil:
	// no new line ever comes.
	LogLines chan admin.LogLine
}

var _ admin.Backend = (*Fake)(nil)

// New returns a Fake with two gossip keys and the given events.
func New(events ...admin.Event) *Fake {
	return &Fake{
		History: events,
		keys: []admin.GossipKey{
			gossipKey("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", true, 3),
			gossipKey("AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=", false, 2),
		},
	}
}

// gossipKey is a key as the agent lists it, with its real fingerprint.
func gossipKey(key string, primary bool, nodes int) admin.GossipKey {
	k, err := identity.ParseGossipKey(key)
	if err != nil {
		panic(err)
	}
	return admin.GossipKey{Key: key, Fingerprint: identity.GossipKeyFingerprint(k).String(), Primary: primary, Nodes: nodes}
}

// Calls returns the changes made so far, as "op by-uid args".
func (f *Fake) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *Fake) record(by admin.Caller, format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("uid=%d ", by.UID)+fmt.Sprintf(format, args...))
}

// Status implements admin.Backend.
func (f *Fake) Status(context.Context) (admin.Status, error) {
	f.mu.Lock()
	n := len(f.overrides)
	f.mu.Unlock()
	return admin.Status{
		Node: "a", Version: "v1.2.3", Started: T0, UptimeSeconds: 3725.4,
		Config: "/etc/infermesh/infermesh.yaml", Generation: 42,
		Mesh:        admin.MeshStatus{State: "joined", GossipAddr: "127.0.0.1:7946", Members: 3, Admitted: 2},
		LocalRoles:  []string{"chat"},
		RemoteRoles: []admin.RemoteRole{{Role: "chat", Nodes: []string{"b"}}, {Role: "embed", Nodes: []string{"b", "c"}}},
		Overrides:   n,
	}, nil
}

// Peers implements admin.Backend.
func (f *Fake) Peers(context.Context) ([]admin.Peer, error) {
	return []admin.Peer{
		{Name: "a", State: admin.PeerSelf, Scope: "full", GossipAddr: "127.0.0.1:7946", QUICAddr: "127.0.0.1:7947", PublicKey: "pubA", Roles: []string{}},
		{Name: "b", State: admin.PeerAdmitted, Scope: "full", GossipAddr: "127.0.0.2:7946", QUICAddr: "127.0.0.2:7947", PublicKey: "pubB", Roles: []string{"chat", "embed"}},
		{Name: "x", State: admin.PeerNotAdmitted, Why: "revoked", GossipAddr: "127.0.0.9:7946", PublicKey: "pubX", Roles: []string{}},
	}, nil
}

// MeshView implements admin.MeshViewer: a, b serving chat to us, c
// serving chat but not allowlisted and not answering the info call, x
// not admitted.
func (f *Fake) MeshView(context.Context) (admin.MeshView, error) {
	at := func(d time.Duration) *time.Time { t := T0.Add(d); return &t }
	two, one := uint32(2), uint32(1)
	return admin.MeshView{Node: "a", Nodes: []admin.MeshNode{
		{Name: "a", State: admin.PeerSelf, Scope: "full", Version: "v1.2.3", StartedAt: at(-time.Hour), CertExpires: at(29 * 24 * time.Hour),
			Roles: []admin.MeshRole{{Name: "embed", Model: "bge", ServesUs: true, Load: 0, InFlight: &one}}},
		{Name: "b", State: admin.PeerAdmitted, Scope: "full", Version: "v1.2.3", StartedAt: at(-2 * time.Hour), CertExpires: at(3 * time.Hour),
			LastHeard: at(-2 * time.Second), RTTMillis: 0.42,
			Roles: []admin.MeshRole{{Name: "chat", Model: "llama-3-8b", ServesUs: true, Load: 1, InFlight: &two,
				Capacity: &admin.Capacity{Slots: 4, Running: 2, Waiting: 1, KVUsage: 0.42, CacheHitRatio: &fakeHitRatio}}}},
		{Name: "c", State: admin.PeerAdmitted, Scope: "full", InfoError: "c answered the info call with 404 Not Found", CertExpires: at(-time.Minute),
			LastHeard: at(-75 * time.Second), RTTMillis: 1.5,
			Roles: []admin.MeshRole{{Name: "chat", Model: "llama-3-8b", Why: []string{"not_allowlisted"}, Load: 4}}},
		{Name: "x", State: admin.PeerNotAdmitted, Why: "revoked", Roles: []admin.MeshRole{}},
	}}, nil
}

// Roles implements admin.Backend.
func (f *Fake) Roles(context.Context) ([]admin.Role, error) {
	at := T0.Add(time.Hour)
	return []admin.Role{
		{
			Name: "chat", Configured: true, Addr: "127.0.0.1:18080",
			Local:      &admin.LocalTarget{Base: "http://127.0.0.1:8081", Model: "llama-3-8b", Runtime: "static"},
			Expose:     admin.Rule{On: true, Source: admin.SourceConfig},
			ServeTo:    []admin.Rule{{Node: "b", On: true, Source: admin.SourceConfig}, {Node: "c", On: true, Source: admin.SourceRuntime, By: "uid 0 (root) pid 1", At: &at}},
			AcceptFrom: []admin.Rule{{Node: "b", On: true, Source: admin.SourceConfig}, {Node: "c", On: false, Source: admin.SourceRuntime, By: "uid 0 (root) pid 1", At: &at}},
			Remotes:    []admin.RemoteAd{{Node: "b", Model: "llama-3-8b", Load: 2, AgeSeconds: 3.5, Fresh: true}},
		},
		{
			Name: "embed", Configured: true, Addr: "127.0.0.1:18081",
			Expose:     admin.Rule{On: false, Source: admin.SourceDefault},
			ServeTo:    []admin.Rule{},
			AcceptFrom: []admin.Rule{{Node: "b", On: true, Source: admin.SourceConfig}, {Node: "c", On: true, Source: admin.SourceConfig}},
			Remotes:    []admin.RemoteAd{{Node: "b", Model: "e5", Load: 0, AgeSeconds: 1, Fresh: true}, {Node: "c", Model: "e5", Load: 1, AgeSeconds: 75, Fresh: false}},
		},
	}, nil
}

// Route implements admin.Backend.
func (f *Fake) Route(_ context.Context, role string) (admin.Route, error) {
	if role != "chat" {
		return admin.Route{}, admin.Errorf(admin.ErrNotFound, "role %q is not configured on this node", role)
	}
	return admin.Route{
		Role: "chat", Generation: 42, Serving: "a", Queue: 2, CacheHitRatio: &fakeHitRatio,
		Decisions: []admin.Decision{
			{Node: "a", Kind: "local", Candidate: true, Rank: 0, Model: "llama-3-8b"},
			{Node: "b", Kind: "remote", Candidate: true, Rank: 1, Model: "llama-3-8b", Load: 2, HasAdvert: true, AgeSeconds: 3.5,
				Capacity: &admin.Capacity{Slots: 4, Running: 2, KVUsage: 0.42, CacheHitRatio: &fakeHitRatio},
				Notes:    []string{"cooled down until 2026-03-04T05:07:07Z after 3 failure(s): tried last"}},
			{Node: "c", Kind: "remote", Rank: -1, Reasons: []string{"node not allowlisted for role", "advertisement expired"}, Model: "llama-3-8b", HasAdvert: true, AgeSeconds: 75},
		},
	}, nil
}

// Policy implements admin.Backend.
func (f *Fake) Policy(context.Context) ([]admin.Override, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]admin.Override{}, f.overrides...), nil
}

// SetPolicy implements admin.Backend.
func (f *Fake) SetPolicy(_ context.Context, by admin.Caller, c admin.PolicyChange) (admin.PolicyResult, error) {
	switch c.Kind {
	case admin.KindAcceptFrom, admin.KindServeTo, admin.KindExpose, admin.KindRevoke:
	default:
		return admin.PolicyResult{}, admin.Errorf(admin.ErrInvalid, "unknown policy kind %q", c.Kind)
	}
	f.record(by, "policy %s %s %s %v", c.Kind, c.Role, c.Node, c.On)
	o := admin.Override{Kind: c.Kind, Role: c.Role, Node: c.Node, On: c.On, At: T0.Add(2 * time.Hour), By: "uid 0 (root) pid 1", Active: true}
	f.mu.Lock()
	f.overrides = append(f.overrides, o)
	f.mu.Unlock()
	return admin.PolicyResult{Override: o, Changed: true}, nil
}

// ResetPolicy implements admin.Backend.
func (f *Fake) ResetPolicy(_ context.Context, by admin.Caller, pf admin.PolicyFilter) (admin.ResetResult, error) {
	f.record(by, "reset %s %s %s", pf.Kind, pf.Role, pf.Node)
	f.mu.Lock()
	defer f.mu.Unlock()
	var keep, gone []admin.Override
	for _, o := range f.overrides {
		if (pf.Kind == "" || pf.Kind == o.Kind) && (pf.Role == "" || pf.Role == o.Role) && (pf.Node == "" || pf.Node == o.Node) {
			gone = append(gone, o)
		} else {
			keep = append(keep, o)
		}
	}
	f.overrides = keep
	if gone == nil {
		gone = []admin.Override{}
	}
	return admin.ResetResult{Removed: gone}, nil
}

// Keyring implements admin.Backend.
func (f *Fake) Keyring(context.Context) (admin.Keyring, error) {
	if f.NoMesh {
		return admin.Keyring{}, admin.Errorf(admin.ErrNotConfigured, "the mesh is not configured on this node (mesh.bind is empty)")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return admin.Keyring{Members: 3, Keys: append([]admin.GossipKey(nil), f.keys...)}, nil
}

// ChangeKeyring implements admin.Backend.
func (f *Fake) ChangeKeyring(ctx context.Context, by admin.Caller, c admin.KeyringChange) (admin.Keyring, error) {
	if f.NoMesh {
		return f.Keyring(ctx)
	}
	f.record(by, "keyring %s %s", c.Op, c.Key)
	if c.Op == admin.KeyringRemove {
		f.mu.Lock()
		primary := len(f.keys) > 0 && f.keys[0].Key == c.Key
		f.mu.Unlock()
		if primary {
			return admin.Keyring{}, admin.Errorf(admin.ErrConflict, "the primary gossip key cannot be removed")
		}
	}
	return f.Keyring(ctx)
}

// Events implements admin.Backend.
func (f *Fake) Events(ctx context.Context, o admin.EventsOptions, fn func(admin.Event) error) error {
	h := f.History
	if o.Last > 0 && o.Last < len(h) {
		h = h[len(h)-o.Last:]
	}
	for _, e := range h {
		if err := fn(e); err != nil {
			return err
		}
	}
	if f.HistorySent != nil {
		f.sentOnce.Do(func() { close(f.HistorySent) })
	}
	if !o.Follow {
		return nil
	}
	<-ctx.Done()
	return nil
}

// Reload implements admin.Backend.
func (f *Fake) Reload(_ context.Context, by admin.Caller) (admin.ReloadResult, error) {
	f.record(by, "reload")
	return admin.ReloadResult{
		Config:       "/etc/infermesh/infermesh.yaml",
		Applied:      []string{"roles.chat.accept_from: +c", "roles.chat.expose: false -> true"},
		NeedsRestart: []string{"roles.chat.port: 18080 -> 18090"},
		Generation:   43,
	}, nil
}

// Instances implements admin.Backend.
func (f *Fake) Instances(context.Context) ([]admin.Instance, error) {
	if f.NoInstances {
		return nil, admin.Errorf(admin.ErrNotConfigured, "provisioning is not configured on this node (no role has an instance)")
	}
	return []admin.Instance{
		{Role: "embed", State: "ready", Ref: "infermesh-default-a-embed-1", ContainerID: "0123456789ab", Endpoint: "127.0.0.1:32768", Image: "llama-server:local", Restarts: 1, Since: T0},
	}, nil
}

// StopInstance implements admin.Backend: embed stops, anything else has no
// instance.
func (f *Fake) StopInstance(_ context.Context, by admin.Caller, role string) (admin.Instance, error) {
	if role != "embed" {
		return admin.Instance{}, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	f.record(by, "instance-stop %s", role)
	return admin.Instance{Role: "embed", State: "stopped", Ref: "infermesh-default-a-embed-1", Image: "llama-server:local", Restarts: 1, Since: T0,
		LastError: "stopped by the operator; `infermesh instances retry ROLE` starts it again"}, nil
}

// RetryInstance implements admin.Backend: embed is serving (a conflict),
// anything else has no instance.
func (f *Fake) RetryInstance(_ context.Context, _ admin.Caller, role string) (admin.Instance, error) {
	if role != "embed" {
		return admin.Instance{}, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	return admin.Instance{}, admin.Errorf(admin.ErrConflict, "role %q is ready: instance has not failed", role)
}

// InstanceLogs implements admin.Backend.
func (f *Fake) InstanceLogs(_ context.Context, role string, n int) ([]admin.LogLine, error) {
	if role != "embed" {
		return nil, admin.Errorf(admin.ErrNotFound, "no managed instance for role %q", role)
	}
	lines := []admin.LogLine{
		{Time: T0, Stream: "stdout", Line: "loading model"},
		{Time: T0.Add(time.Second), Stream: "stderr", Line: "listening on :8080"},
	}
	if n > 0 && n < len(lines) {
		lines = lines[len(lines)-n:]
	}
	return lines, nil
}

var _ admin.LogsBackend = (*Fake)(nil)

// FollowInstanceLogs implements admin.LogsBackend: embed's recent lines,
// then every line sent on LogLines, until ctx ends or LogLines is closed
// (the instance went away: ErrNotFound).
func (f *Fake) FollowInstanceLogs(ctx context.Context, role string, n int, fn func(admin.LogLine) error) error {
	lines, err := f.InstanceLogs(ctx, role, n)
	if err != nil {
		return err
	}
	for _, l := range lines {
		if err := fn(l); err != nil {
			return err
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case l, ok := <-f.LogLines:
			if !ok {
				return admin.Errorf(admin.ErrNotFound, "role %q has no managed instance any more", role)
			}
			if err := fn(l); err != nil {
				return err
			}
		}
	}
}

// fakeHitRatio is the canned route's local cache hit ratio.
var fakeHitRatio = 0.75
