package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
)

// Mesh membership commands.

func init() {
	register(newJoinCmd)
}

func newJoinCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "join ADDR...",
		Short: "Contact gossip addresses (host:port) now; the agent keeps rejoining them",
		Long: `join contacts the given gossip addresses at once. The agent needs no help to
stay in the mesh: it rejoins its configured mesh.join addresses and the peers it
saw last (kept in its state store) whenever they are not live members. Addresses
given here are added to those it rejoins, until the agent restarts.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.JoinResult, error) {
				return c.Join(ctx, args)
			}, func(r admin.JoinResult) string {
				return fmt.Sprintf("contacted %d of %d; members: %s\n", r.Contacted, len(args), strings.Join(r.Members, ", "))
			})
		},
	}
}
