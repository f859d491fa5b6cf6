package agent

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/store"
)

// render writes an effective policy as one stable line per fact, e.g.
// "accept chat/b on config", so the table below can say what it wants.
func render(p effectivePolicy) []string {
	var out []string
	f := func(f fact) string {
		s := fmt.Sprintf("%v %s", f.on, f.source)
		if f.by != "" {
			s += " by " + f.by
		}
		return s
	}
	for _, role := range sortedKeys(p.expose) {
		out = append(out, fmt.Sprintf("expose %s %s", role, f(p.expose[role])))
	}
	for _, m := range []struct {
		name string
		m    map[string]map[string]fact
	}{{"serve", p.serve}, {"accept", p.accept}} {
		for _, role := range sortedKeys(m.m) {
			for _, n := range sortedKeys(m.m[role]) {
				out = append(out, fmt.Sprintf("%s %s/%s %s", m.name, role, n, f(m.m[role][n])))
			}
		}
	}
	for _, n := range sortedKeys(p.revoked) {
		out = append(out, fmt.Sprintf("revoked %s %s", n, f(p.revoked[n])))
	}
	for k := range p.inactive {
		out = append(out, fmt.Sprintf("inactive %s/%s/%s", k.Kind, k.Role, k.Node))
	}
	slices.Sort(out)
	out = append(out, fmt.Sprintf("active %d", p.active))
	return out
}

func TestComputePolicy(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	ov := func(kind store.Kind, role, node string, on bool) store.Override {
		return store.Override{Kind: kind, Role: role, Node: node, On: on, By: "uid=0", At: at}
	}
	cfg := &Config{Roles: map[string]RoleConfig{
		"chat":  {Expose: true, ServeTo: []string{"b"}, AcceptFrom: []string{"b", "c"}},
		"embed": {},
	}}
	tests := []struct {
		name string
		ovs  []store.Override
		want []string
	}{
		{
			name: "the config alone",
			want: []string{
				"accept chat/b true config", "accept chat/c true config",
				"expose chat true config", "expose embed false default",
				"serve chat/b true config",
				"active 0",
			},
		},
		{
			name: "an override turns a config fact off and says who",
			ovs:  []store.Override{ov(store.KindAcceptFrom, "chat", "c", false)},
			want: []string{
				"accept chat/b true config", "accept chat/c false runtime by uid=0",
				"expose chat true config", "expose embed false default",
				"serve chat/b true config",
				"active 1",
			},
		},
		{
			name: "overrides add what the config lacks",
			ovs: []store.Override{
				ov(store.KindExpose, "embed", "", true),
				ov(store.KindServeTo, "embed", "d", true),
				ov(store.KindAcceptFrom, "embed", "e", true),
			},
			want: []string{
				"accept chat/b true config", "accept chat/c true config", "accept embed/e true runtime by uid=0",
				"expose chat true config", "expose embed true runtime by uid=0",
				"serve chat/b true config", "serve embed/d true runtime by uid=0",
				"active 3",
			},
		},
		{
			name: "unexpose at run time beats expose in the config",
			ovs:  []store.Override{ov(store.KindExpose, "chat", "", false)},
			want: []string{
				"accept chat/b true config", "accept chat/c true config",
				"expose chat false runtime by uid=0", "expose embed false default",
				"serve chat/b true config",
				"active 1",
			},
		},
		{
			name: "an override of a role the config lacks is kept inactive",
			ovs:  []store.Override{ov(store.KindAcceptFrom, "gone", "b", true), ov(store.KindExpose, "gone", "", true)},
			want: []string{
				"accept chat/b true config", "accept chat/c true config",
				"expose chat true config", "expose embed false default",
				"inactive accept_from/gone/b", "inactive expose/gone/",
				"serve chat/b true config",
				"active 0",
			},
		},
		{
			name: "revocations apply whatever the roles",
			ovs:  []store.Override{ov(store.KindRevoke, "", "x", true)},
			want: []string{
				"accept chat/b true config", "accept chat/c true config",
				"expose chat true config", "expose embed false default",
				"revoked x true runtime by uid=0",
				"serve chat/b true config",
				"active 1",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := render(computePolicy(cfg, tt.ovs))
			if !slices.Equal(got, tt.want) {
				t.Errorf("computePolicy =\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tt.want, "\n  "))
			}
		})
	}
}

func TestPolicyLookup(t *testing.T) {
	cfg := &Config{Roles: map[string]RoleConfig{"chat": {Expose: true, AcceptFrom: []string{"b"}}}}
	p := computePolicy(cfg, []store.Override{
		{Kind: store.KindServeTo, Role: "chat", Node: "c", On: true},
		{Kind: store.KindRevoke, Node: "x", On: true},
	})
	tests := []struct {
		key        store.Key
		on         bool
		wantSource string
	}{
		{store.Key{Kind: store.KindExpose, Role: "chat"}, true, admin.SourceConfig},
		{store.Key{Kind: store.KindAcceptFrom, Role: "chat", Node: "b"}, true, admin.SourceConfig},
		{store.Key{Kind: store.KindServeTo, Role: "chat", Node: "c"}, true, admin.SourceRuntime},
		{store.Key{Kind: store.KindRevoke, Node: "x"}, true, admin.SourceRuntime},
		{store.Key{Kind: store.KindAcceptFrom, Role: "chat", Node: "z"}, false, ""},
		{store.Key{Kind: store.KindExpose, Role: "nope"}, false, ""},
		{store.Key{Kind: "bogus"}, false, ""},
	}
	for _, tt := range tests {
		if f := p.lookup(tt.key); f.on != tt.on || f.source != tt.wantSource {
			t.Errorf("lookup(%+v) = %v %q, want %v %q", tt.key, f.on, f.source, tt.on, tt.wantSource)
		}
	}
	if got := onSet(p.accept["chat"]); len(got) != 1 || !got["b"] {
		t.Errorf("onSet(accept chat) = %v, want {b}", got)
	}
}
