package agent

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestDiffConfig(t *testing.T) {
	base := func() *Config {
		return &Config{
			Node:  NodeConfig{Name: "a", StateDir: "/var/lib/infermesh"},
			Site:  "default",
			Log:   LogConfig{Level: "info", Format: "json"},
			Mesh:  MeshConfig{Bind: "127.0.0.1:7946", Join: []string{"127.0.0.2:7946"}, AdvertTTL: time.Minute},
			Trust: TrustConfig{Revoked: []string{"x"}},
			Admin: AdminConfig{Socket: "/run/infermesh/admin.sock"},
			Proxy: ProxyConfig{ConnectTimeout: 2 * time.Second},
			Roles: map[string]RoleConfig{
				"chat": {Port: 18080, Upstream: "http://127.0.0.1:8081", Model: "llama", Expose: true,
					ServeTo: []string{"b", "c"}, AcceptFrom: []string{"b"}},
				"embed": {Port: 18081, Instance: &InstanceConfig{Image: "e5:1", Port: 8080}},
			},
		}
	}
	tests := []struct {
		name             string
		edit             func(c *Config)
		applied, restart []string
	}{
		{name: "unchanged", edit: func(*Config) {}},
		{
			name: "the same lists in another order",
			edit: func(c *Config) {
				r := c.Roles["chat"]
				r.ServeTo = []string{"c", "b"}
				c.Roles["chat"] = r
			},
		},
		{
			name: "role policy is applied",
			edit: func(c *Config) {
				r := c.Roles["chat"]
				r.Expose = false
				r.ServeTo = []string{"c", "d"}
				r.AcceptFrom = nil
				c.Roles["chat"] = r
			},
			applied: []string{"roles.chat.expose: true -> false", "roles.chat.serve_to: +d -b", "roles.chat.accept_from: -b"},
		},
		{
			name: "a role's listener and instance need a restart",
			edit: func(c *Config) {
				r := c.Roles["chat"]
				r.Port, r.Upstream, r.Model = 18090, "http://127.0.0.1:9000", "mistral"
				c.Roles["chat"] = r
				e := c.Roles["embed"]
				e.Instance = &InstanceConfig{Image: "e5:2", Port: 8080}
				c.Roles["embed"] = e
			},
			restart: []string{
				"roles.chat.port: 18080 -> 18090",
				`roles.chat.upstream: "http://127.0.0.1:8081" -> "http://127.0.0.1:9000"`,
				`roles.chat.model: "llama" -> "mistral"`,
				"roles.embed.instance: changed",
			},
		},
		{
			name: "roles added and removed",
			edit: func(c *Config) {
				delete(c.Roles, "embed")
				c.Roles["rerank"] = RoleConfig{Port: 18082}
			},
			restart: []string{"roles.embed: removed (its run-time overrides are kept, inactive)", "roles.rerank: added"},
		},
		{
			name: "other sections, field by field",
			edit: func(c *Config) {
				c.Site = "lab"
				c.Log.Level = "debug"
				c.Mesh.AdvertTTL = 2 * time.Minute
				c.Mesh.Join = nil
				c.Trust.Revoked = []string{"x", "y"}
				c.Proxy.ConnectTimeout = time.Second
			},
			restart: []string{
				"site: default -> lab",
				"log.level: info -> debug",
				"mesh.join: changed",
				"mesh.advert_ttl: 1m0s -> 2m0s",
				"trust.revoked: changed",
				"proxy.connect_timeout: 2s -> 1s",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old, next := base(), base()
			tt.edit(next)
			applied, restart := diffConfig(old, next)
			if tt.applied == nil {
				tt.applied = []string{}
			}
			if tt.restart == nil {
				tt.restart = []string{}
			}
			if !slices.Equal(applied, tt.applied) {
				t.Errorf("applied = %q, want %q", applied, tt.applied)
			}
			if !slices.Equal(restart, tt.restart) {
				t.Errorf("needs restart = %q, want %q", restart, tt.restart)
			}
		})
	}
}

func TestStructDiff(t *testing.T) {
	type inner struct {
		A int `yaml:"a"`
	}
	type section struct {
		Name     string            `yaml:"name"`
		Count    int               `yaml:"count,omitempty"`
		List     []string          `yaml:"list"`
		Map      map[string]string `yaml:"map"`
		Inner    inner             `yaml:"inner"`
		Ptr      *inner            `yaml:"ptr"`
		Untagged string
		Skipped  string `yaml:"-"`
		hidden   string
	}
	base := section{Name: "a", Count: 1, List: []string{"x"}, Map: map[string]string{"k": "v"}, Inner: inner{1}, Ptr: &inner{1}, Untagged: "u", Skipped: "s", hidden: "h"}
	tests := []struct {
		name string
		edit func(*section)
		want []string
	}{
		{"equal", func(*section) {}, nil},
		{"equal pointees", func(s *section) { s.Ptr = &inner{1} }, nil},
		{"scalars show both values", func(s *section) { s.Name, s.Count = "b", 2 }, []string{"p.name: a -> b", "p.count: 1 -> 2"}},
		{"composites say changed", func(s *section) {
			s.List = []string{"y"}
			s.Map = nil
			s.Inner = inner{2}
			s.Ptr = nil
		}, []string{"p.list: changed", "p.map: changed", "p.inner: changed", "p.ptr: changed"}},
		{"fields without a yaml name are not config", func(s *section) { s.Untagged, s.Skipped, s.hidden = "1", "2", "3" }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := base
			tt.edit(&n)
			got := structDiff("p", reflect.ValueOf(base), reflect.ValueOf(n))
			if !slices.Equal(got, tt.want) {
				t.Errorf("structDiff = %q, want %q", got, tt.want)
			}
		})
	}
	// A section that is not a struct (site) compares as a value.
	if got := structDiff("site", reflect.ValueOf("a"), reflect.ValueOf("b")); strings.Join(got, "|") != "site: a -> b" {
		t.Errorf("structDiff of a string = %q, want site: a -> b", got)
	}
	if got := structDiff("site", reflect.ValueOf("a"), reflect.ValueOf("a")); got != nil {
		t.Errorf("structDiff of equal strings = %q, want none", got)
	}
}

func TestListDiff(t *testing.T) {
	tests := []struct {
		old, next []string
		want      string
	}{
		{nil, nil, ""},
		{[]string{"a", "b"}, []string{"b", "a"}, ""},
		{[]string{"a", "a"}, []string{"a"}, ""},
		{nil, []string{"b", "a"}, "+a +b"},
		{[]string{"a", "c"}, []string{"b", "c"}, "+b -a"},
	}
	for _, tt := range tests {
		if got := listDiff(tt.old, tt.next); got != tt.want {
			t.Errorf("listDiff(%q, %q) = %q, want %q", tt.old, tt.next, got, tt.want)
		}
	}
}
