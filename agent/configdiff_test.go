package agent

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestEveryConfigFieldHasAReloadClass walks the Config type: every field
// declares how a reload applies it (a section's fields declare their own),
// so a field added without one fails here instead of being neither applied
// nor reported. A list's or a map's elements change with the list: their
// fields must say the list's class. A derived (unexported) field is live
// and secret (it is never put back, never shown).
func TestEveryConfigFieldHasAReloadClass(t *testing.T) {
	var walk func(t *testing.T, typ reflect.Type, path string, within reloadClass)
	walk = func(t *testing.T, typ reflect.Type, path string, within reloadClass) {
		for i := range typ.NumField() {
			sf := typ.Field(i)
			p := joinPath(path, cmpOr(fieldName(sf), sf.Name))
			if isSection(sf.Type) {
				if _, ok := sf.Tag.Lookup("reload"); ok {
					t.Errorf("%s is a section: its fields declare their reload class, it must not", p)
				}
				walk(t, sf.Type, p, within)
				continue
			}
			tag, err := parseReloadTag(sf)
			if err != nil {
				t.Errorf("%s: %v", p, err)
				continue
			}
			if tag.skip {
				if sf.IsExported() {
					t.Errorf(`%s: reload:"-" is for what is not a setting; a field of the file has a class`, p)
				}
				continue
			}
			if !sf.IsExported() && (tag.from == "" || tag.class != classLive || !tag.secret) {
				t.Errorf(`%s: an unexported field is derived: want reload:"live,secret,from=<field>", got %q`, p, sf.Tag.Get("reload"))
			}
			if tag.set && sf.Type != reflect.TypeFor[[]string]() {
				t.Errorf("%s: set is for a list of strings, not %s", p, sf.Type)
			}
			if within != "" && tag.class != within {
				t.Errorf("%s: class %s in a list of class %s (it changes with the list)", p, tag.class, within)
			}
			elem := sf.Type
			for elem.Kind() == reflect.Pointer || elem.Kind() == reflect.Slice || elem.Kind() == reflect.Map {
				elem = elem.Elem()
			}
			if !isSection(elem) {
				continue
			}
			switch sf.Type.Kind() {
			case reflect.Map, reflect.Pointer:
				// Roles and an instance: compared field by field.
				if sf.Type.Kind() == reflect.Map {
					p += ".<name>"
				}
				walk(t, elem, p, within)
			default:
				walk(t, elem, p+"[]", tag.class)
			}
		}
	}
	walk(t, reflect.TypeFor[Config](), "", "")
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// TestEveryReloadClassHasAPart: a running agent has a part for every
// class but restart (waits) and live (storing the config applies it).
func TestEveryReloadClassHasAPart(t *testing.T) {
	a := &Agent{}
	parts := a.reloadParts()
	parts[classPolicy] = policyPart{}
	for _, c := range reloadClasses {
		_, ok := parts[c]
		if want := c != classRestart && c != classLive; ok != want {
			t.Errorf("class %s: has a part = %v, want %v", c, ok, want)
		}
	}
}

func diffBase() *Config {
	tr := true
	return &Config{
		Node:  NodeConfig{Name: "a", StateDir: "/var/lib/infermesh"},
		Site:  "default",
		Log:   LogConfig{Level: "info", Format: "json"},
		Mesh:  MeshConfig{Bind: "127.0.0.1:7946", Join: []string{"127.0.0.2:7946"}, AdvertTTL: time.Minute},
		Trust: TrustConfig{Authority: "authority-key-one", Nodes: []TrustedNode{{Name: "b", PublicKey: "b-key-one", Scope: "full"}}, Revoked: []string{"x"}},
		Admin: AdminConfig{Socket: "/run/infermesh/admin.sock"},
		Proxy: ProxyConfig{ConnectTimeout: 2 * time.Second, AccessLog: &tr},
		Roles: map[string]RoleConfig{
			"chat": {Port: 18080, Upstream: "http://127.0.0.1:8081", Model: "llama", Expose: true,
				ServeTo: []string{"b", "c"}, AcceptFrom: []string{"b"}, UpstreamAPIKeyFile: "/etc/infermesh/chat.key", upstreamKey: "sk-one"},
			"embed": {Port: 18081, Instance: &InstanceConfig{Image: "e5:1", Port: 8080, Env: map[string]string{"HF_TOKEN": "hf-one"},
				Args: []string{"--api-key", "vllm-one"}, Restart: RestartPolicy{Max: 5}}},
		},
	}
}

// editRole edits role name of c in place.
func editRole(c *Config, name string, edit func(r *RoleConfig)) {
	r := c.Roles[name]
	edit(&r)
	c.Roles[name] = r
}

// editInstance edits the instance of role name, a copy of it.
func editInstance(c *Config, name string, edit func(in *InstanceConfig)) {
	editRole(c, name, func(r *RoleConfig) {
		in := *r.Instance
		edit(&in)
		r.Instance = &in
	})
}

func TestDiffConfig(t *testing.T) {
	tests := []struct {
		name string
		edit func(c *Config)
		want []string // "<class> <change>"
	}{
		{name: "unchanged", edit: func(*Config) {}},
		{
			name: "the same lists in another order, or empty",
			edit: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.ServeTo = []string{"c", "b", "c"} })
				c.Trust.Revoked = []string{"x", "x"}
				editInstance(c, "embed", func(in *InstanceConfig) { in.Mounts = []Mount{} }) // empty is none
			},
		},
		{
			name: "role policy",
			edit: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.Expose, r.ServeTo, r.AcceptFrom = false, []string{"c", "d"}, nil })
			},
			want: []string{"policy roles.chat.expose: true -> false", "policy roles.chat.serve_to: +d -b", "policy roles.chat.accept_from: -b"},
		},
		{
			name: "how a role is served",
			edit: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.Port, r.Upstream, r.Model = 18090, "http://127.0.0.1:9000", "" })
			},
			want: []string{
				"role roles.chat.port: 18080 -> 18090",
				`role roles.chat.upstream: "http://127.0.0.1:8081" -> "http://127.0.0.1:9000"`,
				`role roles.chat.model: "llama" -> ""`,
			},
		},
		{
			name: "an instance, field by field",
			edit: func(c *Config) {
				editInstance(c, "embed", func(in *InstanceConfig) {
					in.Image, in.Restart.Max, in.StopWithAgent, in.Mounts = "e5:2", 3, true, []Mount{{Host: "/m", Container: "/m"}}
				})
			},
			want: []string{
				`instance roles.embed.instance.image: "e5:1" -> "e5:2"`,
				"instance roles.embed.instance.mounts: changed",
				"instance roles.embed.instance.restart.max: 5 -> 3",
				"live roles.embed.instance.stop_with_agent: false -> true",
			},
		},
		{
			name: "an instance added and removed",
			edit: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.Upstream, r.Instance = "", &InstanceConfig{Runtime: "simulated"} })
				editRole(c, "embed", func(r *RoleConfig) { r.Instance = nil })
			},
			want: []string{
				`role roles.chat.upstream: "http://127.0.0.1:8081" -> ""`,
				"instance roles.chat.instance: added",
				"instance roles.embed.instance: removed",
			},
		},
		{
			name: "roles added and removed",
			edit: func(c *Config) {
				delete(c.Roles, "embed")
				c.Roles["rerank"] = RoleConfig{Port: 18082, upstreamKey: "sk-rerank"}
			},
			want: []string{"role roles.embed: removed (its run-time overrides are kept, inactive)", "role roles.rerank: added"},
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
				c.Proxy.ShutdownTimeout = time.Minute
				c.Proxy.AccessLog = nil
			},
			want: []string{
				`restart site: "default" -> "lab"`,
				`restart log.level: "info" -> "debug"`,
				"restart mesh.join: changed",
				"restart mesh.advert_ttl: 1m0s -> 2m0s",
				"trust trust.revoked: +y",
				"restart proxy.connect_timeout: 2s -> 1s",
				"live proxy.shutdown_timeout: 0s -> 1m0s",
				"restart proxy.access_log: true -> (default)",
			},
		},
		{
			name: "secrets say only that they changed",
			edit: func(c *Config) {
				c.Trust.Authority = "authority-key-two"
				c.Trust.Certificate = "certificate-two"
				c.Trust.Nodes[0].PublicKey = "b-key-two"
				editRole(c, "chat", func(r *RoleConfig) { r.upstreamKey = "sk-two" })
				editInstance(c, "embed", func(in *InstanceConfig) {
					in.Env = map[string]string{"HF_TOKEN": "hf-two"}
					in.Args = []string{"--api-key", "vllm-two"}
				})
			},
			want: []string{
				"trust trust.authority: changed (secret, not shown)",
				"restart trust.certificate: changed (secret, not shown)",
				"trust trust.nodes: changed (secret, not shown)",
				"live roles.chat.upstream_api_key_file: its content changed (secret, not shown)",
				"instance roles.embed.instance.args: changed (secret, not shown)",
				"instance roles.embed.instance.env: changed (secret, not shown)",
			},
		},
		{
			name: "a key file named anew",
			edit: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.UpstreamAPIKeyFile = "/etc/infermesh/chat2.key" })
			},
			want: []string{`live roles.chat.upstream_api_key_file: "/etc/infermesh/chat.key" -> "/etc/infermesh/chat2.key"`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old, next := diffBase(), diffBase()
			tt.edit(next)
			var got []string
			for _, c := range diffConfig(old, next) {
				got = append(got, string(c.class)+" "+c.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("diffConfig =\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tt.want, "\n  "))
			}
		})
	}
}

// TestDiffConfigShowsNoSecret: a change of a field that holds key
// material carries neither its old nor its new value, in its fields or in
// its text, and a role or instance added or removed carries no value.
func TestDiffConfigShowsNoSecret(t *testing.T) {
	old, next := diffBase(), diffBase()
	next.Trust.Authority, next.Trust.Certificate = "authority-key-two", "certificate-two"
	next.Trust.Nodes = append(next.Trust.Nodes, TrustedNode{Name: "c", PublicKey: "c-key-two"})
	editRole(next, "chat", func(r *RoleConfig) { r.upstreamKey = "sk-two" })
	editInstance(next, "embed", func(in *InstanceConfig) {
		in.Env = map[string]string{"HF_TOKEN": "hf-two"}
		in.Args = []string{"--api-key", "vllm-two"}
	})
	next.Roles["rerank"] = RoleConfig{Port: 18082, upstreamKey: "sk-rerank", Instance: &InstanceConfig{Env: map[string]string{"T": "hf-rerank"}}}
	old.Roles["gone"] = RoleConfig{Port: 18083, upstreamKey: "sk-gone"}
	changes := diffConfig(old, next)
	if len(changes) != 8 {
		t.Fatalf("%d changes, want 8: %v", len(changes), changes)
	}
	for _, c := range changes {
		shown := fmt.Sprintf("%s %#v %#v", c, c.old, c.new)
		for _, secret := range []string{"-one", "-two", "sk-", "hf-"} {
			if strings.Contains(shown, secret) {
				t.Errorf("change %s shows a secret (%q): %s", c.path, secret, shown)
			}
		}
		if c.old != nil || c.new != nil {
			t.Errorf("change %s: old %v, new %v; want neither", c.path, c.old, c.new)
		}
	}
}

// TestWithOld: the config in force is the new one with the changes that
// wait put back, and building it writes neither config.
func TestWithOld(t *testing.T) {
	edit := func(c *Config) {
		c.Log.Level = "debug"
		editRole(c, "chat", func(r *RoleConfig) { r.Port, r.Expose, r.upstreamKey = 18090, false, "sk-two" })
		editInstance(c, "embed", func(in *InstanceConfig) { in.Image, in.StopWithAgent = "e5:2", true })
		c.Roles["rerank"] = RoleConfig{Port: 18082}
	}
	tests := []struct {
		name string
		undo []string // paths of the changes that wait
		want func(c *Config)
	}{
		{name: "nothing waits", want: edit},
		{
			name: "some of each section wait",
			undo: []string{"log.level", "roles.chat.port", "roles.embed.instance.image", "roles.rerank"},
			want: func(c *Config) {
				editRole(c, "chat", func(r *RoleConfig) { r.Expose, r.upstreamKey = false, "sk-two" })
				editInstance(c, "embed", func(in *InstanceConfig) { in.StopWithAgent = true })
			},
		},
		{
			name: "a role removed waits",
			undo: []string{"roles.embed"},
			want: func(c *Config) {
				edit(c)
				c.Roles["embed"] = diffBase().Roles["embed"]
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old, next := diffBase(), diffBase()
			edit(next)
			if tt.name == "a role removed waits" {
				delete(next.Roles, "embed")
			}
			var undo []configChange
			for _, c := range diffConfig(old, next) {
				if slices.Contains(tt.undo, c.path) {
					undo = append(undo, c)
				}
			}
			if len(undo) != len(tt.undo) {
				t.Fatalf("found %d of the changes %q", len(undo), tt.undo)
			}
			oldCopy, nextCopy := diffBase(), diffBase()
			edit(nextCopy)
			if tt.name == "a role removed waits" {
				delete(nextCopy.Roles, "embed")
			}
			got := withOld(next, old, undo)
			want := diffBase()
			tt.want(want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("withOld = %+v\nwant %+v", got, want)
			}
			if !reflect.DeepEqual(old, oldCopy) || !reflect.DeepEqual(next, nextCopy) {
				t.Error("withOld wrote into the configs it was given")
			}
		})
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

// waitingPart is a reloadPart whose plan makes the changes at its paths
// wait.
type waitingPart map[string]string

func (w waitingPart) plan(_, _ *Config, changes []configChange) (map[string]string, error) {
	out := map[string]string{}
	for _, c := range changes {
		if why, ok := w[c.path]; ok {
			out[c.path] = why
		}
	}
	return out, nil
}

func (waitingPart) apply(*Config, *Config, []configChange) []reloadFailure { return nil }

// TestPlanReloadHoldsARolesServingWhole: when a part makes one of a role's
// serving changes (port, upstream, model, instance) wait, the role's other
// serving changes wait with it, whichever part they belong to; its policy
// and live fields, and other roles, do not; a class without a part waits.
func TestPlanReloadHoldsARolesServingWhole(t *testing.T) {
	edit := func(c *Config) {
		editRole(c, "chat", func(r *RoleConfig) { r.Port, r.Expose, r.UpstreamAPIKeyFile = 18090, false, "/k" })
		editInstance(c, "embed", func(in *InstanceConfig) { in.Image, in.StopWithAgent = "e5:2", true })
		editRole(c, "embed", func(r *RoleConfig) { r.Model = "e5" })
		c.Site = "lab"
	}
	tests := []struct {
		name  string
		parts map[reloadClass]reloadPart
		want  map[string]string // path -> why, of the changes that wait
	}{
		{
			name:  "every part applies its own",
			parts: map[reloadClass]reloadPart{classRole: waitingPart{}, classInstance: waitingPart{}, classPolicy: waitingPart{}},
			want:  map[string]string{"site": ""},
		},
		{
			name: "an instance field waits: the role's model with it",
			parts: map[reloadClass]reloadPart{classRole: waitingPart{}, classPolicy: waitingPart{},
				classInstance: waitingPart{"roles.embed.instance.image": "no manager"}},
			want: map[string]string{"site": "", "roles.embed.instance.image": "no manager", "roles.embed.model": "with roles.embed.instance.image"},
		},
		{
			name:  "no part for roles and instances",
			parts: map[reloadClass]reloadPart{classPolicy: waitingPart{}},
			want:  map[string]string{"site": "", "roles.chat.port": "", "roles.embed.model": "", "roles.embed.instance.image": ""},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old, next := diffBase(), diffBase()
			edit(next)
			changes := diffConfig(old, next)
			waits, err := (&Backend{parts: tt.parts}).planReload(old, next, changes)
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]string{}
			for i, why := range waits {
				got[changes[i].path] = why
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("waits = %q, want %q", got, tt.want)
			}
		})
	}
}
