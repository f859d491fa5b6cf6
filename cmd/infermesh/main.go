// Command infermesh is the operator CLI: offline key tools (keygen,
// authority) and, over the agent's admin socket, everything else.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"
)

// DefaultSocket is the agent's admin socket when neither --socket nor
// INFERMESH_SOCKET says otherwise.
const DefaultSocket = "/run/infermesh/admin.sock"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// app is what every command shares: global flags and output.
type app struct {
	json   bool
	socket string
	out    io.Writer
	errOut io.Writer
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
		socket = DefaultSocket
	}
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print JSON")
	root.PersistentFlags().StringVar(&a.socket, "socket", socket, "agent admin socket (env INFERMESH_SOCKET)")
	for _, f := range commands {
		root.AddCommand(f(a))
	}
	return root
}

func run(args []string, out, errOut io.Writer) int {
	a := &app{out: out, errOut: errOut}
	root := newRoot(a)
	root.SetArgs(args)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(errOut, "infermesh:", err)
		return 1
	}
	return 0
}
