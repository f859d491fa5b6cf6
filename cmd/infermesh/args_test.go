package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestPositionalArgsSayWhatTheyWant walks every command: a wrong number
// of positional arguments is a usage error (exit 64) that names what the
// command wants and how it is called, never cobra's "accepts 1 arg(s),
// received 0".
func TestPositionalArgsSayWhatTheyWant(t *testing.T) {
	if _, errOut, code := runCLI(t, "route"); code != exitUsage || errOut != "infermesh: route needs a ROLE: infermesh route ROLE\n" {
		t.Errorf("route with no argument = exit %d, %q; want 64 and what it needs", code, errOut)
	}
	if _, errOut, code := runCLI(t, "allow", "chat"); code != exitUsage || errOut != "infermesh: allow needs a NODE after \"chat\": infermesh allow ROLE NODE\n" {
		t.Errorf("allow chat = exit %d, %q; want 64 and what it needs", code, errOut)
	}
	root := newRoot(&app{out: &bytes.Buffer{}, errOut: &bytes.Buffer{}})
	var walk func(c *cobra.Command)
	checked := 0
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			walk(sub)
		}
		if c.RunE == nil || c.Args == nil || c.Name() == "help" || c.Name() == "completion" || strings.HasPrefix(c.Name(), "__") {
			return
		}
		path := strings.Fields(c.CommandPath())[1:]
		names := argNames(c)
		var tries [][]string
		switch {
		case len(names) == 0:
			tries = append(tries, append(append([]string(nil), path...), "extra"))
		case strings.HasSuffix(names[len(names)-1], "..."):
			tries = append(tries, path)
		default:
			tries = append(tries, path[:len(path):len(path)])
			more := append([]string(nil), path...)
			for range names {
				more = append(more, "x")
			}
			tries = append(tries, append(more, "extra"))
		}
		for _, args := range tries {
			checked++
			_, errOut, code := runCLI(t, args...)
			if code != exitUsage || strings.Contains(errOut, "arg(s)") || !strings.Contains(errOut, cmdName(c)) {
				t.Errorf("infermesh %s = exit %d, %q; want 64 and what %s wants", strings.Join(args, " "), code, errOut, cmdName(c))
			}
			if len(names) > 0 && !strings.Contains(errOut, usageLine(c)) {
				t.Errorf("infermesh %s: %q does not show the call %q", strings.Join(args, " "), errOut, usageLine(c))
			}
		}
	}
	walk(root)
	if checked < 30 {
		t.Errorf("checked %d command lines, want every command's (30 or more)", checked)
	}
}
