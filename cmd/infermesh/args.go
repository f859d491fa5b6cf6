package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

// Positional arguments. Every command says what it takes with one of
// these instead of cobra's validators, so that a wrong count is answered
// with what the command wants, in the words of its Use line ("route needs
// a ROLE: infermesh route ROLE"), not "accepts 1 arg(s), received 0".

// noArgs: the command takes no positional argument.
func noArgs(c *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	if c.HasAvailableSubCommands() {
		// A group that also runs on its own (instances): the argument
		// was meant as one of its commands.
		return usageErrorf("unknown command %q for %q (its commands: %s)", args[0], c.CommandPath(), subNames(c))
	}
	return usageErrorf("%s takes no arguments (got %s): %s", cmdName(c), quoteArgs(args), usageLine(c))
}

// exactArgs: the command takes exactly n, named by its Use line.
func exactArgs(n int) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		switch {
		case len(args) < n:
			return usageErrorf("%s needs %s%s: %s", cmdName(c), wanted(c, len(args)), gotSoFar(args), usageLine(c))
		case len(args) > n:
			return usageErrorf("%s takes only %s (got %d arguments: %s): %s", cmdName(c), strings.Join(argNames(c), " "), len(args), quoteArgs(args), usageLine(c))
		}
		return nil
	}
}

// minArgs: the command takes n or more (its Use line ends in "NAME...").
func minArgs(n int) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if len(args) < n {
			return usageErrorf("%s needs %s%s: %s", cmdName(c), wanted(c, len(args)), gotSoFar(args), usageLine(c))
		}
		return nil
	}
}

func subNames(c *cobra.Command) string {
	var names []string
	for _, s := range c.Commands() {
		if s.IsAvailableCommand() {
			names = append(names, s.Name())
		}
	}
	return strings.Join(names, ", ")
}

// cmdName is the command without the program's name: "keyring install".
func cmdName(c *cobra.Command) string {
	if c.HasParent() {
		return strings.TrimPrefix(c.CommandPath(), c.Root().Name()+" ")
	}
	return c.Name()
}

// argNames are the placeholders of c's Use line: "allow ROLE NODE" has
// ROLE and NODE.
func argNames(c *cobra.Command) []string {
	f := strings.Fields(c.Use)
	if len(f) < 2 {
		return nil
	}
	return f[1:]
}

// wanted names the arguments still missing after have were given: "a
// ROLE", "ROLE and NODE", "at least one ADDR".
func wanted(c *cobra.Command, have int) string {
	names := argNames(c)
	if have < len(names) {
		names = names[have:]
	}
	for i, n := range names {
		names[i] = strings.TrimSuffix(n, "...")
	}
	if len(names) == 1 {
		if strings.HasSuffix(argNames(c)[len(argNames(c))-1], "...") {
			return "at least one " + names[0]
		}
		return article(names[0]) + " " + names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// gotSoFar says what was given when some arguments were.
func gotSoFar(args []string) string {
	if len(args) == 0 {
		return ""
	}
	return " after " + quoteArgs(args)
}

func article(name string) string {
	if name != "" && strings.ContainsRune("AEIOU", rune(name[0])) {
		return "an"
	}
	return "a"
}

func quoteArgs(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = fmt.Sprintf("%q", a)
	}
	return strings.Join(q, " ")
}

// usageLine is how the command is called: "infermesh route ROLE".
func usageLine(c *cobra.Command) string {
	line := c.CommandPath()
	if names := argNames(c); len(names) > 0 {
		line += " " + strings.Join(names, " ")
	}
	return line
}
