// Command infermesh is the operator CLI: offline key tools (keygen,
// authority: package identity) and, over the agent's admin socket (package
// agent/admin's client), everything else. It links neither the mesh nor
// the agent: a test keeps it so.
package main

import (
	"github.com/infermesh/infermesh/config"

	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// app is what every command shares: global flags and output.
type app struct {
	json   bool
	socket string
	wait   time.Duration
	out    io.Writer
	errOut io.Writer
}

// client returns a client of the agent's admin socket.
func (a *app) client() *admin.Client {
	return admin.NewClient(a.socket, admin.ClientOptions{Wait: a.wait})
}

// print writes v as JSON with --json, else text.
func (a *app) print(v any, text string) error {
	if a.json {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	_, err := fmt.Fprintln(a.out, text)
	return err
}

// commands are the subcommand constructors; each file registers its own
// in init, so adding commands does not touch the root.
var commands []func(*app) *cobra.Command

func register(f func(*app) *cobra.Command) { commands = append(commands, f) }

// subcommands attach to a group another file registers (node leave joins
// the node group), so files adding to one group do not touch each other.
var subcommands []struct {
	parent string
	f      func(*app) *cobra.Command
}

func registerSub(parent string, f func(*app) *cobra.Command) {
	subcommands = append(subcommands, struct {
		parent string
		f      func(*app) *cobra.Command
	}{parent, f})
}

func newRoot(a *app) *cobra.Command {
	root := &cobra.Command{
		Use:           "infermesh",
		Short:         "Operate an infermesh node",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(a.out)
	root.SetErr(a.errOut)
	socket := os.Getenv("INFERMESH_SOCKET")
	if socket == "" {
		socket = config.DefaultAdminSocket
	}
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print JSON")
	root.PersistentFlags().StringVar(&a.socket, "socket", socket, "agent admin socket (env INFERMESH_SOCKET)")
	root.PersistentFlags().DurationVar(&a.wait, "wait", admin.DefaultWait, "how long to keep trying to reach an agent that is starting")
	for _, f := range commands {
		root.AddCommand(f(a))
	}
	for _, s := range subcommands {
		var parent *cobra.Command
		for _, c := range root.Commands() {
			if c.Name() == s.parent {
				parent = c
			}
		}
		if parent == nil {
			parent = &cobra.Command{Use: s.parent, Short: "Operate on " + s.parent + "s"}
			root.AddCommand(parent)
		}
		parent.AddCommand(s.f(a))
	}
	markUsageErrors(root)
	return root
}

func run(args []string, out, errOut io.Writer) int {
	// Ctrl-C ends a follow (events -f) cleanly.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return runContext(ctx, args, out, errOut)
}

// runContext runs the command line args until it is done or ctx ends, and
// returns the exit code.
func runContext(ctx context.Context, args []string, out, errOut io.Writer) int {
	a := &app{out: out, errOut: errOut}
	root := newRoot(a)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	if isCobraUsage(err) {
		err = &usageError{msg: err.Error()}
	}
	err = explainRefusal(err, config.DefaultFile)
	code := exitCode(err)
	// --json is parsed by then unless the flags themselves were the error;
	// look for it in args so a bad command line answers in JSON too.
	asJSON := a.json
	for _, arg := range args {
		if arg == "--" {
			break
		}
		asJSON = asJSON || arg == "--json" || arg == "--json=true"
	}
	reportError(errOut, asJSON, err, code)
	return code
}
