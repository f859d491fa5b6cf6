package agent

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// checkKeys walks the YAML document against the type it decodes into and
// returns every problem the decoder would report without naming the field,
// or would not report at all, each by its line and full path:
//   - a key the type does not have, with the nearest known key as a hint
//     (strict decoding catches it too, but names only the key and a Go type);
//   - a key given twice in one mapping;
//   - a value of the wrong kind (a string for a number, a list for a
//     string, a scalar for a section);
//   - a number with a fraction (or an exponent) for an integer, which
//     the decoder would silently truncate (port: 28100.5 as 28100);
//   - a bare number for a duration, which the decoder would read as
//     nanoseconds or refuse without naming the field.
func checkKeys(doc *yaml.Node, t reflect.Type) error {
	var errs []string
	walkKeys(doc, t, "", &errs)
	if len(errs) == 0 {
		return nil
	}
	return errors.New(strings.Join(errs, "; "))
}

var (
	durationType    = reflect.TypeFor[time.Duration]()
	unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()
)

func walkKeys(n *yaml.Node, t reflect.Type, path string, errs *[]string) {
	if n == nil || n.Kind == 0 { // 0: an empty file
		return
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			walkKeys(c, t, path, errs)
		}
		return
	case yaml.AliasNode:
		walkKeys(n.Alias, t, path, errs)
		return
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // an empty value: the zero value, as the decoder leaves it
	}
	fail := func(format string, args ...any) {
		*errs = append(*errs, fmt.Sprintf("line %d: %s: %s", n.Line, cmp.Or(path, "the config"), fmt.Sprintf(format, args...)))
	}
	if reflect.PointerTo(t).Implements(unmarshalerType) {
		// The type parses itself (GPUs, ByteSize) and says what is wrong.
		if err := n.Decode(reflect.New(t).Interface()); err != nil {
			fail("%v", err)
		}
		return
	}
	if t == durationType {
		switch {
		case n.Kind != yaml.ScalarNode:
			fail("want a duration (e.g. 5s, 500ms, 2m), got %s", describeNode(n))
		case n.Tag == "!!int" || n.Tag == "!!float":
			fail("%s has no unit; write %ss (or ms, m, h)", n.Value, n.Value)
		default:
			if _, err := time.ParseDuration(n.Value); err != nil {
				fail("%q is not a duration (e.g. 5s, 500ms, 2m)", n.Value)
			}
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			fail("want a section of keys (key: value lines), got %s", describeNode(n))
			return
		}
		fields := yamlFields(t)
		seen := map[string]int{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := joinPath(path, k.Value)
			if setTwice(seen, k, p, errs) {
				continue
			}
			ft, ok := fields[k.Value]
			if !ok {
				msg := fmt.Sprintf("line %d: unknown key %q (%s)", k.Line, k.Value, p)
				if s := nearest(k.Value, fields); s != "" {
					msg += fmt.Sprintf("; did you mean %q?", s)
				}
				*errs = append(*errs, msg)
				continue
			}
			walkKeys(v, ft, p, errs)
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			fail("want a mapping (name: value, ...), got %s", describeNode(n))
			return
		}
		seen := map[string]int{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			p := joinPath(path, k.Value)
			if setTwice(seen, k, p, errs) {
				continue
			}
			walkKeys(n.Content[i+1], t.Elem(), p, errs)
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			fail("want a list ([a, b] or one \"- item\" line each), got %s", describeNode(n))
			return
		}
		for i, c := range n.Content {
			walkKeys(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i), errs)
		}
	default:
		checkScalar(n, t, fail)
	}
}

// setTwice reports (into errs) whether key k, at path p, was seen before
// in its mapping (seen: key -> the line it was first on), and records it.
func setTwice(seen map[string]int, k *yaml.Node, p string, errs *[]string) bool {
	if first, dup := seen[k.Value]; dup {
		*errs = append(*errs, fmt.Sprintf("line %d: %s: set twice (first on line %d)", k.Line, p, first))
		return true
	}
	seen[k.Value] = k.Line
	return false
}

// checkScalar checks a value for a field of a scalar type: a string, a
// bool, an integer or a float.
func checkScalar(n *yaml.Node, t reflect.Type, fail func(format string, args ...any)) {
	want := map[reflect.Kind]string{reflect.String: "a string", reflect.Bool: "true or false"}[t.Kind()]
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		want = "a whole number"
	case reflect.Float32, reflect.Float64:
		want = "a number"
	}
	if n.Kind != yaml.ScalarNode {
		fail("want %s, got %s", want, describeNode(n))
		return
	}
	switch {
	case want == "a whole number" && n.Tag == "!!float":
		var f float64
		switch err := n.Decode(&f); {
		case err != nil || f != math.Trunc(f):
			fail("%s is not a whole number", n.Value)
		case math.Abs(f) >= 1<<53:
			fail("%s is out of range", n.Value)
		default:
			fail("%s has a fraction or an exponent; write the whole number %d", n.Value, int64(f))
		}
		return
	case want == "a whole number" || want == "a number":
		if n.Tag == "!!str" && n.Style&(yaml.DoubleQuotedStyle|yaml.SingleQuotedStyle) != 0 {
			var probe yaml.Node
			if yaml.Unmarshal([]byte(n.Value), &probe) == nil && len(probe.Content) == 1 &&
				(probe.Content[0].Tag == "!!int" || probe.Content[0].Tag == "!!float") {
				fail("%s is quoted, which makes it a string; write it without quotes", describeNode(n))
				return
			}
		}
	}
	if err := n.Decode(reflect.New(t).Interface()); err != nil {
		if n.Tag == "!!int" && want == "a whole number" {
			fail("%s is out of range", n.Value)
			return
		}
		fail("%s is not %s", describeNode(n), want)
	}
}

// describeNode says what a YAML value is, for an error message.
func describeNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a section of keys"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	}
	if n.Tag == "!!str" {
		return fmt.Sprintf("%q", n.Value)
	}
	return n.Value
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// yamlFields maps the yaml keys of struct t to their types.
func yamlFields(t reflect.Type) map[string]reflect.Type {
	m := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		m[name] = f.Type
	}
	return m
}

// nearest returns the key of known closest to k when it is close enough to
// be the one meant (a typo, a dash for an underscore), else "".
func nearest(k string, known map[string]reflect.Type) string {
	best, bestD := "", 0
	for name := range known {
		d := editDistance(strings.ReplaceAll(strings.ToLower(k), "-", "_"), name)
		if best == "" || d < bestD || (d == bestD && name < best) {
			best, bestD = name, d
		}
	}
	if best == "" || bestD > max(2, len(k)/3) {
		return ""
	}
	return best
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
