package agent

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
)

// diffConfig lists what changed from old to next: role policy (applied at
// once) and everything else (needs a restart unless OnReload applies it).
func diffConfig(old, next *Config) (applied, restart []string) {
	applied, restart = []string{}, []string{}
	for _, name := range sortedKeys(unionKeys(old.Roles, next.Roles)) {
		o, inOld := old.Roles[name]
		n, inNew := next.Roles[name]
		f := "roles." + name
		switch {
		case !inOld:
			restart = append(restart, f+": added")
			continue
		case !inNew:
			restart = append(restart, f+": removed (its run-time overrides are kept, inactive)")
			continue
		}
		if o.Expose != n.Expose {
			applied = append(applied, fmt.Sprintf("%s.expose: %v -> %v", f, o.Expose, n.Expose))
		}
		if d := listDiff(o.ServeTo, n.ServeTo); d != "" {
			applied = append(applied, f+".serve_to: "+d)
		}
		if d := listDiff(o.AcceptFrom, n.AcceptFrom); d != "" {
			applied = append(applied, f+".accept_from: "+d)
		}
		if o.Port != n.Port {
			restart = append(restart, fmt.Sprintf("%s.port: %d -> %d", f, o.Port, n.Port))
		}
		if o.Upstream != n.Upstream {
			restart = append(restart, fmt.Sprintf("%s.upstream: %q -> %q", f, o.Upstream, n.Upstream))
		}
		if o.Model != n.Model {
			restart = append(restart, fmt.Sprintf("%s.model: %q -> %q", f, o.Model, n.Model))
		}
		if !reflect.DeepEqual(o.Instance, n.Instance) {
			restart = append(restart, f+".instance: changed")
		}
	}
	sections := []struct {
		name     string
		old, new any
	}{
		{"node", old.Node, next.Node}, {"site", old.Site, next.Site}, {"log", old.Log, next.Log},
		{"mesh", old.Mesh, next.Mesh}, {"trust", old.Trust, next.Trust}, {"admin", old.Admin, next.Admin},
		{"proxy", old.Proxy, next.Proxy},
	}
	for _, s := range sections {
		restart = append(restart, structDiff(s.name, reflect.ValueOf(s.old), reflect.ValueOf(s.new))...)
	}
	return applied, restart
}

// listDiff says "+added -removed" between two node lists ("" if equal as
// sets).
func listDiff(old, next []string) string {
	o, n := map[string]bool{}, map[string]bool{}
	for _, x := range old {
		o[x] = true
	}
	for _, x := range next {
		n[x] = true
	}
	var parts []string
	for _, x := range sortedKeys(n) {
		if !o[x] {
			parts = append(parts, "+"+x)
		}
	}
	for _, x := range sortedKeys(o) {
		if !n[x] {
			parts = append(parts, "-"+x)
		}
	}
	return strings.Join(parts, " ")
}

// structDiff lists the yaml fields of a config section that differ.
func structDiff(prefix string, o, n reflect.Value) []string {
	if o.Kind() != reflect.Struct {
		if reflect.DeepEqual(o.Interface(), n.Interface()) {
			return nil
		}
		return []string{fmt.Sprintf("%s: %v -> %v", prefix, o.Interface(), n.Interface())}
	}
	var out []string
	for i := range o.NumField() {
		sf := o.Type().Field(i)
		tag, _, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
		if !sf.IsExported() || tag == "" || tag == "-" {
			continue
		}
		ov, nv := o.Field(i).Interface(), n.Field(i).Interface()
		if reflect.DeepEqual(ov, nv) {
			continue
		}
		switch o.Field(i).Kind() {
		case reflect.Slice, reflect.Map, reflect.Struct, reflect.Pointer:
			out = append(out, prefix+"."+tag+": changed")
		default:
			out = append(out, fmt.Sprintf("%s.%s: %v -> %v", prefix, tag, ov, nv))
		}
	}
	return out
}

// runningConfig is the config in force after a reload from old (in force
// until now) to next, so that the next reload compares the file with what
// runs rather than with the last file read: next's role policy, and next's
// trust and instances unless the reload left them for a restart (they are
// in needsRestart); old's everything else. A role added by next waits for a
// restart (its listener), so it is not in force; a role next removed is no
// longer in force for policy (its overrides turn inactive).
func runningConfig(old, next *Config, needsRestart []string) *Config {
	pending := func(prefix string) bool {
		return slices.ContainsFunc(needsRestart, func(c string) bool { return strings.HasPrefix(c, prefix) })
	}
	r := *old
	r.Roles = make(map[string]RoleConfig, len(old.Roles))
	for name, o := range old.Roles {
		n, ok := next.Roles[name]
		if !ok {
			continue
		}
		o.Expose, o.ServeTo, o.AcceptFrom = n.Expose, n.ServeTo, n.AcceptFrom
		if !pending("roles." + name + ".instance:") {
			o.Instance = n.Instance
		}
		r.Roles[name] = o
	}
	if !pending("trust") {
		r.Trust = next.Trust
	}
	return &r
}
