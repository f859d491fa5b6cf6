package main

import (
	"flag"
	"fmt"
	"io"
	"strings"
)

// The --help text, in the shape of the infermesh CLI's (cobra): what the
// command is, how to call it, its flags in groups, examples. Go's flag
// package takes every flag with one dash or two; the text shows two, as
// the CLI does.

// flagGroups orders the flags of newFlags under their headings. Every flag
// is in exactly one group (a test checks); one that is not would still be
// printed, under "Other".
var flagGroups = []struct {
	title string
	names []string
}{
	{"Configuration", []string{"config", "validate", "log-level"}},
	{"Node key and state store (repair)", []string{"keygen", "reset-state", "new-identity"}},
	{"Development", []string{"dev", "dev-port", "dev-token-delay"}},
	{"Other", []string{"version"}},
}

const usageIntro = `infermeshd is the infermesh agent, one on every host. It serves the loopback
OpenAI-compatible proxy (a port per role), routes each request to the local
inference instance or to an admitted peer over QUIC, gossips signed adverts
with its peers, runs the managed inference instances, and answers the admin
socket, through which the infermesh CLI operates it.

Usage:
  infermeshd [flags]
`

const usageExamples = `Examples:
  # check a config file, then run the agent with it (as the systemd unit does)
  infermeshd --validate --config /etc/infermesh/infermesh.yaml
  infermeshd --config /etc/infermesh/infermesh.yaml

  # try it out: one node, the demo model as role chat on 127.0.0.1:18080
  infermeshd --dev

Every flag takes one dash or two (-config or --config). Exit status: 0 after
a clean stop, 64 for a bad command line, 78 for a bad config, 1 otherwise.
SIGTERM drains and stops the agent; SIGHUP reloads the config file.
`

// usageWidth is the width the flag descriptions are wrapped to.
const usageWidth = 80

// writeUsage prints the --help text of fs.
func writeUsage(w io.Writer, fs *flag.FlagSet) {
	type row struct{ left, desc string }
	grouped := map[string]bool{}
	var sections [][]row
	var titles []string
	add := func(title string, rows []row) {
		if len(rows) > 0 {
			titles, sections = append(titles, title), append(sections, rows)
		}
	}
	flagRow := func(f *flag.Flag) row {
		name, desc := flag.UnquoteUsage(f)
		left := "      --" + f.Name
		if name != "" {
			left += " " + name
		}
		_, isString := f.Value.(flag.Getter).Get().(string)
		switch {
		case f.DefValue == "" || f.DefValue == "false":
		case isString:
			desc += fmt.Sprintf(" (default %q)", f.DefValue)
		default:
			desc += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		return row{left, desc}
	}
	for _, g := range flagGroups {
		var rows []row
		for _, n := range g.names {
			if f := fs.Lookup(n); f != nil {
				grouped[n] = true
				rows = append(rows, flagRow(f))
			}
		}
		if g.title == "Other" {
			fs.VisitAll(func(f *flag.Flag) {
				if !grouped[f.Name] {
					rows = append(rows, flagRow(f))
				}
			})
			rows = append(rows, row{"  -h, --help", "print this help and exit"})
		}
		add(g.title, rows)
	}
	col := 0
	for _, rows := range sections {
		for _, r := range rows {
			col = max(col, len(r.left)+3)
		}
	}
	var b strings.Builder
	b.WriteString(usageIntro)
	for i, rows := range sections {
		fmt.Fprintf(&b, "\n%s:\n", titles[i])
		for _, r := range rows {
			b.WriteString(r.left)
			b.WriteString(strings.Repeat(" ", col-len(r.left)))
			b.WriteString(wrap(r.desc, col, usageWidth))
			b.WriteByte('\n')
		}
	}
	b.WriteString("\n")
	b.WriteString(usageExamples)
	_, _ = io.WriteString(w, b.String())
}

// wrap breaks text into lines of at most width columns (a longer word
// stays whole), the first starting at column indent and the others
// indented to it.
func wrap(text string, indent, width int) string {
	var b strings.Builder
	col := indent
	for i, word := range strings.Fields(text) {
		if i > 0 {
			if col+1+len(word) > width {
				b.WriteString("\n" + strings.Repeat(" ", indent))
				col = indent
			} else {
				b.WriteByte(' ')
				col++
			}
		}
		b.WriteString(word)
		col += len(word)
	}
	return b.String()
}
