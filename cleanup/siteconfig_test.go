package cleanup

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/config"
)

func TestParseSiteConfig(t *testing.T) {
	host, _ := os.Hostname()
	for _, tt := range []struct {
		name  string
		yaml  string
		want  SiteConfig
		kinds []Kind
	}{
		{"empty: the agent's defaults", "", SiteConfig{Site: "default", Node: host, StateDir: config.DefaultStateDir, CacheRoot: config.DefaultCacheDir, AdminSocket: config.DefaultAdminSocket}, []Kind{}},
		{"every binding kind", `
site: s1
node: {name: a, state_dir: /srv/im, cache_dir: /srv/cache}
admin: {socket: /srv/im/admin.sock}
roles:
  chat: {port: 1, instance: {image: x, port: 8080}}
  embed: {port: 2, instance: {runtime: native, command: /usr/bin/llama-server, port: 8081}}
  demo: {port: 3, instance: {runtime: simulated}}
  static: {port: 4, upstream: "http://127.0.0.1:9"}
`, SiteConfig{Site: "s1", Node: "a", StateDir: "/srv/im", CacheRoot: "/srv/cache", AdminSocket: "/srv/im/admin.sock"}, []Kind{Docker, Native, Simulated}},
		{"keys of another version are ignored", `
site: s1
node: {name: a, gpu_pool: big}
telemetry: {endpoint: x}
roles:
  chat: {port: 1, instance: {runtime: docker, image: x, gpus: all}}
`, SiteConfig{Site: "s1", Node: "a", StateDir: config.DefaultStateDir, CacheRoot: config.DefaultCacheDir, AdminSocket: config.DefaultAdminSocket}, []Kind{Docker}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseSiteConfig([]byte(tt.yaml))
			if err != nil {
				t.Fatal(err)
			}
			kinds := got.Bound.Kinds()
			got.Bound = KindSet{}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ParseSiteConfig = %+v, want %+v", got, tt.want)
			}
			if !reflect.DeepEqual(kinds, tt.kinds) {
				t.Errorf("bound kinds = %v, want %v", kinds, tt.kinds)
			}
		})
	}
}

func TestParseSiteConfigUnknownBinding(t *testing.T) {
	_, err := ParseSiteConfig([]byte("roles:\n  chat: {port: 1, instance: {runtime: futureRuntime, image: x}}\n"))
	var ub *UnknownBindingError
	if !errors.As(err, &ub) || ub.Adapter != "futureRuntime" {
		t.Fatalf("err = %v, want an UnknownBindingError for futureRuntime", err)
	}
	const want = `roles.chat.instance.runtime: an execution target binds unknown runtime adapter "futureRuntime", whose resources site cleanup cannot classify`
	if err.Error() != want {
		t.Errorf("err = %q, want %q", err, want)
	}
	if errors.Is(err, ErrConfigUnreadable) {
		t.Error("an unknown binding must not read as an unreadable config (which would select every kind and go on)")
	}
	if _, serr := SelectKinds(SiteConfig{}, err); !errors.As(serr, &ub) {
		t.Errorf("SelectKinds(unknown binding) = %v, want it returned", serr)
	}
}

func TestUnreadableConfig(t *testing.T) {
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.yaml")
	os.WriteFile(garbage, []byte("\x00\xff{{{ not: [yaml"), 0o600)
	wrongShape := filepath.Join(dir, "shape.yaml")
	os.WriteFile(wrongShape, []byte("roles: 7\n"), 0o600)
	badSite := filepath.Join(dir, "site.yaml")
	os.WriteFile(badSite, []byte("site: ../etc\n"), 0o600)
	relative := filepath.Join(dir, "rel.yaml")
	os.WriteFile(relative, []byte("node: {state_dir: var/lib}\n"), 0o600)
	for _, path := range []string{filepath.Join(dir, "missing.yaml"), garbage, wrongShape, badSite, relative} {
		c, err := ReadSiteConfig(path)
		if !errors.Is(err, ErrConfigUnreadable) {
			t.Errorf("ReadSiteConfig(%s) = %v, want ErrConfigUnreadable", filepath.Base(path), err)
			continue
		}
		kinds, err := SelectKinds(c, err)
		if err != nil || !reflect.DeepEqual(kinds.Kinds(), []Kind{Docker, Native, Simulated}) {
			t.Errorf("SelectKinds(%s) = %v, %v; want every kind", filepath.Base(path), kinds.Kinds(), err)
		}
	}
}

func TestScope(t *testing.T) {
	s, err := TargetScope("b", "a", "b")
	if err != nil {
		t.Fatal(err)
	}
	if s.IsSite() || !reflect.DeepEqual(s.Targets(), []string{"a", "b"}) || s.String() != "targets a,b" {
		t.Errorf("TargetScope(b, a, b) = %v", s)
	}
	if !s.Includes("a") || s.Includes("c") || !SiteScope().Includes("c") {
		t.Error("Includes")
	}
	for _, bad := range [][]string{nil, {""}, {"a/b"}, {".."}, {strings.Repeat("x", 64)}} {
		if _, err := TargetScope(bad...); err == nil {
			t.Errorf("TargetScope(%q) = nil error", bad)
		}
	}
	b, _ := s.MarshalJSON()
	if string(b) != `{"kind":"targets","targets":["a","b"]}` {
		t.Errorf("JSON = %s", b)
	}
}
