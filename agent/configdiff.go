package agent

import (
	"cmp"
	"fmt"
	"reflect"
	"slices"
	"strings"
)

// What a reload changes, field by field.
//
// Every field of Config declares in its `reload` struct tag how a change
// of it takes effect while the agent runs: its class, which names the
// part of the agent that applies it, or says that it waits for a restart
// (TestEveryConfigFieldHasAReloadClass walks the type and fails on a field
// without one). diffConfig walks two configs by reflection and returns
// typed changes (path, old, new, class); Backend.Reload asks each class's
// part which of its changes it can apply, makes the config of the ones it
// can the current one, and has each part apply its own. Strings are made
// only for the admin answer (configChange.String).
//
// The tag is `reload:"<class>[,secret][,set][,from=<name>]"`:
//
//	secret  the field is key material, or may hold some (an instance's
//	        environment and arguments): a change says that it changed,
//	        never what it was or is (old and new stay nil). A field whose
//	        type holds a secret field is secret too.
//	set     a list compared as a set: another order or a repeat is no change.
//	from=f  an unexported field Validate derives from field f (the key read
//	        from upstream_api_key_file): its change is reported under f.
//
// A section (a field whose type is a struct) has no tag: its fields have
// theirs. `reload:"-"` marks what is not a setting (the file's path).

// reloadClass says how a change of a config field takes effect.
type reloadClass string

const (
	// classRestart: read once, at start; the change waits for a restart.
	classRestart reloadClass = "restart"
	// classLive: read from the current config where it is used, so storing
	// the config applies it.
	classLive reloadClass = "live"
	// classPolicy: role policy (expose, serve_to, accept_from); the backend
	// applies the config with the run-time overrides on top to the
	// placement table.
	classPolicy reloadClass = "policy"
	// classTrust: who is admitted; the mesh's trust (mesh.SetTrust).
	classTrust reloadClass = "trust"
	// classRole: a role and how it is served here: its port's listener and
	// its local upstream (a static one, a simulated instance); roles added
	// and removed.
	classRole reloadClass = "role"
	// classInstance: a managed instance's spec; the instance manager.
	classInstance reloadClass = "instance"
)

// reloadClasses are the classes, in the order their parts apply a reload.
var reloadClasses = []reloadClass{classRestart, classLive, classTrust, classRole, classPolicy, classInstance}

// reloadTag is a field's parsed `reload` tag.
type reloadTag struct {
	class  reloadClass
	secret bool
	set    bool
	from   string
	skip   bool // "-": not a setting
}

func parseReloadTag(sf reflect.StructField) (reloadTag, error) {
	v, ok := sf.Tag.Lookup("reload")
	if !ok {
		return reloadTag{}, fmt.Errorf("%s has no reload tag", sf.Name)
	}
	if v == "-" {
		return reloadTag{skip: true}, nil
	}
	parts := strings.Split(v, ",")
	t := reloadTag{class: reloadClass(parts[0])}
	if !slices.Contains(reloadClasses, t.class) {
		return t, fmt.Errorf("%s: reload class %q is not one of %v", sf.Name, parts[0], reloadClasses)
	}
	for _, o := range parts[1:] {
		switch {
		case o == "secret":
			t.secret = true
		case o == "set":
			t.set = true
		case strings.HasPrefix(o, "from="):
			t.from = strings.TrimPrefix(o, "from=")
		default:
			return t, fmt.Errorf("%s: unknown reload tag option %q", sf.Name, o)
		}
	}
	return t, nil
}

// isSection reports whether a field of type t is a section: a struct
// whose fields the config file sets one by one (not a type that parses
// itself from one value).
func isSection(t reflect.Type) bool {
	return t.Kind() == reflect.Struct && !reflect.PointerTo(t).Implements(unmarshalerType)
}

// configChange is one field a reload changes.
type configChange struct {
	// path is the field as the config file names it: roles.chat.port.
	path  string
	class reloadClass
	// old and new are the values (a pointer's value, nil for nil). Both
	// stay nil for a secret, and for a role or instance added or removed
	// (the path says which).
	old, new       any
	secret         bool
	set            bool
	derived        bool // from= (reported under the field it is read from)
	added, removed bool
	// steps lead from Config to the field: Go field names and map keys.
	steps []string
}

// role is the role the change is in ("" outside roles).
func (c configChange) role() string {
	if len(c.steps) >= 2 && c.steps[0] == "Roles" {
		return c.steps[1]
	}
	return ""
}

// serving reports whether the change is in how a role is served here
// (its port, upstream, model or instance): those change as a whole.
func (c configChange) serving() bool {
	return c.role() != "" && (c.class == classRole || c.class == classInstance)
}

// String is the change as the admin answer and the log show it.
func (c configChange) String() string {
	switch {
	case c.added:
		return c.path + ": added"
	case c.removed && len(c.steps) == 2 && c.role() != "":
		return c.path + ": removed (its run-time overrides are kept, inactive)"
	case c.removed:
		return c.path + ": removed"
	case c.derived:
		return c.path + ": its content changed (secret, not shown)"
	case c.secret:
		return c.path + ": changed (secret, not shown)"
	case c.set:
		o, _ := c.old.([]string)
		n, _ := c.new.([]string)
		return c.path + ": " + listDiff(o, n)
	}
	if composite(c.old) || composite(c.new) {
		return c.path + ": changed"
	}
	return fmt.Sprintf("%s: %s -> %s", c.path, showValue(c.old), showValue(c.new))
}

func composite(v any) bool {
	if v == nil {
		return false
	}
	switch reflect.TypeOf(v).Kind() {
	case reflect.Slice, reflect.Map, reflect.Struct, reflect.Array:
		return true
	}
	return false
}

// showValue is a value as a change shows it: strings quoted, so that an
// empty one shows; a nil pointer is the field's default.
func showValue(v any) string {
	switch s := v.(type) {
	case nil:
		return "(default)"
	case fmt.Stringer:
		return s.String()
	}
	if reflect.TypeOf(v).Kind() == reflect.String {
		return fmt.Sprintf("%q", v)
	}
	return fmt.Sprint(v)
}

// diffConfig lists what changed from old to next, in the order of the
// config's fields (roles by name).
func diffConfig(old, next *Config) []configChange {
	var d differ
	d.fields(reflect.ValueOf(old).Elem(), reflect.ValueOf(next).Elem(), "", nil)
	return d.out
}

type differ struct{ out []configChange }

// fields compares the fields of two structs of one type.
func (d *differ) fields(o, n reflect.Value, path string, steps []string) {
	t := o.Type()
	for i := range t.NumField() {
		sf := t.Field(i)
		p, st := joinPath(path, fieldName(sf)), append(slices.Clip(steps), sf.Name)
		if isSection(sf.Type) {
			d.fields(o.Field(i), n.Field(i), p, st)
			continue
		}
		tag, err := parseReloadTag(sf)
		if err != nil {
			// TestEveryConfigFieldHasAReloadClass fails on it; should one
			// slip through, its change waits for a restart.
			tag = reloadTag{class: classRestart, secret: true}
		}
		if tag.skip {
			continue
		}
		if tag.from != "" {
			p = joinPath(path, tag.from)
		}
		d.value(o.Field(i), n.Field(i), p, st, tag)
	}
}

// value compares one field's values: a map of sections (roles) and a
// pointer to a section (an instance) by their fields, anything else as
// one value.
func (d *differ) value(o, n reflect.Value, path string, steps []string, tag reloadTag) {
	t := o.Type()
	ch := configChange{path: path, class: tag.class, set: tag.set, derived: tag.from != "", steps: steps,
		secret: tag.secret || holdsSecret(t, map[reflect.Type]bool{})}
	switch {
	case t.Kind() == reflect.Map && isSection(t.Elem()):
		keys := map[string]bool{}
		for _, k := range append(o.MapKeys(), n.MapKeys()...) {
			keys[k.String()] = true
		}
		for _, k := range sortedKeys(keys) {
			kv := reflect.ValueOf(k)
			ov, nv := o.MapIndex(kv), n.MapIndex(kv)
			c := ch
			c.path, c.steps = path+"."+k, append(slices.Clip(steps), k)
			c.secret = false
			switch {
			case !ov.IsValid():
				c.added = true
				d.out = append(d.out, c)
			case !nv.IsValid():
				c.removed = true
				d.out = append(d.out, c)
			default:
				d.fields(ov, nv, c.path, c.steps)
			}
		}
		return
	case t.Kind() == reflect.Pointer && isSection(t.Elem()):
		ch.secret = false
		switch {
		case o.IsNil() && n.IsNil():
		case o.IsNil():
			ch.added = true
			d.out = append(d.out, ch)
		case n.IsNil():
			ch.removed = true
			d.out = append(d.out, ch)
		default:
			d.fields(o.Elem(), n.Elem(), path, steps)
		}
		return
	}
	if sameValue(o, n, tag.set) {
		return
	}
	if !ch.secret {
		ch.old, ch.new = plainValue(o), plainValue(n)
	}
	d.out = append(d.out, ch)
}

// sameValue compares two values of a field; set compares lists of
// strings as sets.
func sameValue(o, n reflect.Value, set bool) bool {
	if !o.CanInterface() {
		// An unexported (derived) field: one of the comparable kinds.
		return o.Equal(n)
	}
	if set {
		return listDiff(o.Interface().([]string), n.Interface().([]string)) == ""
	}
	if k := o.Kind(); (k == reflect.Slice || k == reflect.Map) && o.Len() == 0 && n.Len() == 0 {
		return true // `join: []` is no join at all
	}
	return reflect.DeepEqual(o.Interface(), n.Interface())
}

// plainValue is a field's value to show: a pointer's value, or nil.
func plainValue(v reflect.Value) any {
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return nil
		}
		v = v.Elem()
	}
	return v.Interface()
}

// holdsSecret reports whether values of t hold a field tagged secret.
func holdsSecret(t reflect.Type, seen map[reflect.Type]bool) bool {
	if seen[t] {
		return false
	}
	seen[t] = true
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice, reflect.Array, reflect.Map:
		return holdsSecret(t.Elem(), seen)
	case reflect.Struct:
		for i := range t.NumField() {
			sf := t.Field(i)
			if tag, err := parseReloadTag(sf); err == nil && tag.secret {
				return true
			}
			if holdsSecret(sf.Type, seen) {
				return true
			}
		}
	}
	return false
}

// fieldName is a field's name in the config file ("" for none).
func fieldName(sf reflect.StructField) string {
	if !sf.IsExported() {
		return ""
	}
	name, _, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
	if name == "-" {
		return ""
	}
	return cmp.Or(name, strings.ToLower(sf.Name))
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

// withOld is next with the fields of changes put back to old's values:
// the config in force when those changes wait (or failed) and the rest
// applied. Neither old nor next is modified (every map and pointer on
// the way to a field put back is copied first).
func withOld(next, old *Config, changes []configChange) *Config {
	c := *next
	dst, src := reflect.ValueOf(&c).Elem(), reflect.ValueOf(old).Elem()
	for _, ch := range changes {
		setAt(dst, src, ch.steps)
	}
	return &c
}

// setAt sets dst's field at steps to src's (a map key src lacks is
// deleted). dst is addressable; what it shares with another config is
// copied before it is written.
func setAt(dst, src reflect.Value, steps []string) {
	for dst.Kind() == reflect.Pointer && len(steps) > 0 {
		p := reflect.New(dst.Type().Elem())
		p.Elem().Set(dst.Elem())
		dst.Set(p)
		dst, src = p.Elem(), src.Elem()
	}
	if len(steps) == 0 {
		dst.Set(src)
		return
	}
	switch dst.Kind() {
	case reflect.Struct:
		setAt(dst.FieldByName(steps[0]), src.FieldByName(steps[0]), steps[1:])
	case reflect.Map:
		m := reflect.MakeMapWithSize(dst.Type(), dst.Len())
		for it := dst.MapRange(); it.Next(); {
			m.SetMapIndex(it.Key(), it.Value())
		}
		dst.Set(m)
		k := reflect.ValueOf(steps[0])
		sv := src.MapIndex(k)
		if len(steps) == 1 || !sv.IsValid() {
			m.SetMapIndex(k, sv) // the zero Value deletes
			return
		}
		e := reflect.New(dst.Type().Elem()).Elem()
		e.Set(m.MapIndex(k))
		setAt(e, sv, steps[1:])
		m.SetMapIndex(k, e)
	default:
		panic(fmt.Sprintf("config: no field %q in a %s", steps[0], dst.Type()))
	}
}
