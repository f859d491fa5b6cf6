package agent

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// checkKeys walks the YAML document against the type it decodes into and
// returns every key the type does not have, by its full path and line,
// with the nearest known key as a hint, and every bare number given for a
// duration (yaml would read it as nanoseconds or refuse it without naming
// the field). Strict decoding would catch the keys too, but names only the
// key and a Go type.
func checkKeys(doc *yaml.Node, t reflect.Type) error {
	var errs []string
	walkKeys(doc, t, "", &errs)
	if len(errs) == 0 {
		return nil
	}
	return errors.New(strings.Join(errs, "; "))
}

var durationType = reflect.TypeFor[time.Duration]()

func walkKeys(n *yaml.Node, t reflect.Type, path string, errs *[]string) {
	if n == nil {
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
	if t == durationType {
		if n.Kind == yaml.ScalarNode && (n.Tag == "!!int" || n.Tag == "!!float") {
			*errs = append(*errs, fmt.Sprintf("line %d: %s: %s has no unit; write %ss (or ms, m, h)", n.Line, path, n.Value, n.Value))
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return // a type error: the decoder names it
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := joinPath(path, k.Value)
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
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			walkKeys(n.Content[i+1], t.Elem(), joinPath(path, n.Content[i].Value), errs)
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return
		}
		for i, c := range n.Content {
			walkKeys(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i), errs)
		}
	}
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
