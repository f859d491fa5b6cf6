package main

import (
	"context"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
)

// version is the CLI's version, set at build time (make build:
// -X main.version=...); a plain go build reports its VCS revision.
var version = ""

func init() { register(newVersionCmd) }

// cliVersion is version, or the module's VCS revision, or "dev".
func cliVersion() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if rev != "" && dirty {
			rev += "-dirty"
		}
		if rev != "" {
			return rev
		}
	}
	return "dev"
}

type versionInfo struct {
	CLI   string `json:"cli"`
	Agent string `json:"agent,omitempty"`
	// AgentError says why the agent's version is missing.
	AgentError string `json:"agent_error,omitempty"`
}

func newVersionCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the CLI's version, and the agent's when one answers on the socket",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := versionInfo{CLI: cliVersion()}
			// A missing agent is not an error here: the CLI's own version
			// is still the answer, so wait only briefly.
			c := admin.NewClient(a.socket, admin.ClientOptions{Wait: min(a.wait, 500*time.Millisecond)})
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Second)
			defer cancel()
			if s, err := c.Status(ctx); err != nil {
				v.AgentError = err.Error()
			} else {
				v.Agent = s.Version
			}
			text := "infermesh " + v.CLI
			if v.Agent != "" {
				text += fmt.Sprintf("\nagent     %s (%s)", v.Agent, a.socket)
			} else {
				text += "\nagent     " + v.AgentError // it says why: "agent unreachable: ..."
			}
			return a.print(v, text)
		},
	}
}
