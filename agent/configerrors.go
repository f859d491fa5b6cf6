package agent

import (
	"bytes"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// The YAML library's own errors, in the words of the config: the line a
// syntax error is on, and the key a decoding error is about. checkKeys
// (configkeys.go) catches every type error first, by its path; what
// reaches friendlyYAMLError is what it does not know.

var (
	yamlFieldNotFound = regexp.MustCompile(`line (\d+): field (\S+) not found in type (\S+)`)
	yamlSyntax        = regexp.MustCompile(`^yaml: (?:line (\d+): )?(.*)$`)
)

// maxRescanLines bounds the file syntaxError re-parses line by line.
const maxRescanLines = 2000

// syntaxError rewrites the parser's error for a file that is not YAML at
// all. The parser reports the line where the enclosing block began (a key
// indented one space too few on line 5 is "line 2: did not find expected
// key"), so the line is found again: it is the one after the longest run of
// leading lines that still parses.
func syntaxError(data []byte, err error) error {
	m := yamlSyntax.FindStringSubmatch(err.Error())
	if m == nil {
		return err
	}
	problem := m[2]
	n, _ := strconv.Atoi(m[1])
	lines := bytes.SplitAfter(data, []byte("\n"))
	if len(lines) <= maxRescanLines {
		for k := len(lines) - 1; k >= 0; k-- {
			var doc yaml.Node
			if yaml.Unmarshal(bytes.Join(lines[:k], nil), &doc) == nil {
				n = k + 1
				break
			}
		}
	}
	if n < 1 || n > len(lines) {
		return fmt.Errorf("not valid YAML: %s", problem)
	}
	text := strings.TrimRight(string(lines[n-1]), "\r\n")
	if len(text) > 60 {
		text = text[:57] + "..."
	}
	hint := ""
	switch {
	case strings.Contains(problem, "tab character"):
		hint = " (indent with spaces, not tabs)"
	case strings.Contains(problem, "did not find expected key"),
		strings.Contains(problem, "mapping values are not allowed"),
		strings.Contains(problem, "did not find expected '-' indicator"),
		strings.Contains(problem, "block sequence entries are not allowed"):
		hint = " (check its indentation: a key lines up with the other keys of its section)"
	}
	return fmt.Errorf("line %d (%q): not valid YAML: %s%s", n, text, problem, hint)
}

// friendlyYAMLError names unknown keys as checkKeys does; other decoding
// errors are passed on.
func friendlyYAMLError(err error) error {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs := make([]string, 0, len(te.Errors))
		for _, e := range te.Errors {
			if m := yamlFieldNotFound.FindStringSubmatch(e); m != nil {
				msgs = append(msgs, fmt.Sprintf("line %s: unknown key %q", m[1], m[2]))
				continue
			}
			msgs = append(msgs, e)
		}
		return errors.New(strings.Join(msgs, "; "))
	}
	return err
}
