package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

// The commands that talk to the agent over its admin socket.

func init() {
	register(newStatusCmd)
	register(newPeersCmd)
	register(newRolesCmd)
	register(newRouteCmd)
	register(newAllowCmd)
	register(newDenyCmd)
	register(newServeToCmd)
	register(newExposeCmd)
	register(newUnexposeCmd)
	register(newRevokeCmd)
	register(newUnrevokeCmd)
	register(newPolicyCmd)
	register(newKeyringCmd)
	register(newEventsCmd)
	register(newReloadCmd)
	register(newInstancesCmd)
	register(newMetricsCmd)
}

// call runs f with a client of the socket and prints its answer with
// render (or as JSON).
func call[T any](a *app, cmd *cobra.Command, f func(*admin.Client, context.Context) (T, error), render func(T) string) error {
	c := a.client()
	defer c.Close()
	v, err := f(c, cmd.Context())
	if err != nil {
		return err
	}
	if a.json {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	_, err = fmt.Fprint(a.out, render(v))
	return err
}

func newStatusCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Show the node: version, uptime, mesh, local and remote roles, placement generation",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Status, renderStatus)
		},
	}
}

func newPeersCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "peers",
		Short: "List the mesh members and whether each is admitted",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Peers, renderPeers)
		},
	}
}

func newRolesCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "roles",
		Short: "List the roles with their policy (and where each rule comes from) and the peers serving them",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Roles, renderRoles)
		},
	}
}

func newRouteCmd(a *app) *cobra.Command {
	var serving bool
	var request string
	cmd := &cobra.Command{
		Use:   "route ROLE",
		Short: "Explain which node serves a role now and why every other node does not",
		Long: `route explains ROLE's placement now. With --serving it first waits, up to
--wait, until a node serves ROLE (a script's "wait until it works" step),
and fails (exit 1) with the explanation when none does by then.

With --request ID it shows how one recent request of ROLE (its
X-Request-Id) was routed: every candidate's estimated time to the first
token, in parts, and why the one that answered was chosen.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if request != "" {
				if serving {
					return usageErrorf("--request and --serving do not go together")
				}
				return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.RouteDecision, error) {
					return c.RouteRequest(ctx, args[0], request)
				}, renderRouteDecision)
			}
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.Route, error) {
				if !serving {
					return c.Route(ctx, args[0])
				}
				return waitServed(ctx, c, args[0], a.wait)
			}, renderRoute)
		},
	}
	cmd.Flags().BoolVar(&serving, "serving", false, "wait (up to --wait) until a node serves the role")
	cmd.Flags().StringVar(&request, "request", "", "show how the recent request with this X-Request-Id was routed")
	return cmd
}

// waitServed polls role's route until a node serves it or wait is over.
func waitServed(ctx context.Context, c *admin.Client, role string, wait time.Duration) (admin.Route, error) {
	deadline := time.Now().Add(wait)
	for {
		rt, err := c.Route(ctx, role)
		if err == nil && rt.Serving != "" {
			return rt, nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return rt, err
			}
			return rt, fmt.Errorf("no node serves role %s after %v:\n%s", role, wait, strings.TrimRight(renderRoute(rt), "\n"))
		}
		select {
		case <-ctx.Done():
			return rt, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// setPolicy sends one policy change and prints the result.
func setPolicy(a *app, cmd *cobra.Command, pc admin.PolicyChange) error {
	return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.PolicyResult, error) {
		return c.SetPolicy(ctx, pc)
	}, renderPolicyResult)
}

func newAllowCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "allow ROLE NODE",
		Short: "Let NODE serve ROLE to this node (consumer side, like accept_from)",
		Args:  exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return setPolicy(a, cmd, admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: args[0], Node: args[1], On: true})
		},
	}
}

func newDenyCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "deny ROLE NODE",
		Short: "Stop NODE from serving ROLE to this node, whatever the config says",
		Args:  exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return setPolicy(a, cmd, admin.PolicyChange{Kind: admin.KindAcceptFrom, Role: args[0], Node: args[1], On: false})
		},
	}
}

func newServeToCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve-to",
		Short: "Change the peers this node serves a role to (serving side, like serve_to)",
	}
	for _, op := range []struct {
		use, short string
		on         bool
	}{
		{"add ROLE PEER", "Serve ROLE to PEER (the role must also be exposed)", true},
		{"remove ROLE PEER", "Stop serving ROLE to PEER, whatever the config says", false},
	} {
		cmd.AddCommand(&cobra.Command{
			Use:   op.use,
			Short: op.short,
			Args:  exactArgs(2),
			RunE: func(cmd *cobra.Command, args []string) error {
				return setPolicy(a, cmd, admin.PolicyChange{Kind: admin.KindServeTo, Role: args[0], Node: args[1], On: op.on})
			},
		})
	}
	return cmd
}

func newExposeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "expose ROLE",
		Short: "Let ROLE leave loopback: serve it to the peers on its serve list",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return setPolicy(a, cmd, admin.PolicyChange{Kind: admin.KindExpose, Role: args[0], On: true})
		},
	}
}

func newUnexposeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "unexpose ROLE",
		Short: "Serve ROLE to no peer at all, whatever the config says",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return setPolicy(a, cmd, admin.PolicyChange{Kind: admin.KindExpose, Role: args[0], On: false})
		},
	}
}

func newRevokeCmd(a *app) *cobra.Command {
	return revokeCmd(a, true, "revoke NODE|PUBLIC_KEY", "Revoke a node (by name or base64 public key) at once; kept across restarts",
		`revoke cuts NODE off at once and rotates the gossip key on every admitted
node, over QUIC, so NODE is left with a key nobody uses.

Without --authority-key the revocation is this node's alone: the other
nodes still admit NODE, and take keyring changes from it, until each of
them revokes it too. With --authority-key (trust by an authority) the
revocation is a statement signed by the authority key: every node takes it
from anyone, spreads it by gossip and over QUIC, keeps it across restarts,
and refuses NODE from then on, its keyring changes included. The key is
read here, signs the statement and is neither sent nor stored.`)
}

func newUnrevokeCmd(a *app) *cobra.Command {
	return revokeCmd(a, false, "unrevoke NODE|PUBLIC_KEY", "Lift a revocation (those in trust.revoked stay until the config changes)",
		`unrevoke lifts a run-time revocation of NODE on this node, or, with
--authority-key, a signed one everywhere (a newer statement, which every
node takes as it took the revocation). Then it gives NODE this node's gossip
keyring over QUIC: the key rotated while NODE was revoked, and without it
NODE can neither read nor speak gossip. When NODE cannot be reached, it
prints the commands to run on NODE.`)
}

// revokeCmd is revoke (on) or unrevoke.
func revokeCmd(a *app, on bool, use, short, long string) *cobra.Command {
	var authorityKey string
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  long,
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			pc := admin.PolicyChange{Kind: admin.KindRevoke, Node: args[0], On: on}
			if authorityKey == "" {
				return setPolicy(a, cmd, pc)
			}
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.PolicyResult, error) {
				st, err := signRevocation(ctx, c, authorityKey, args[0], on)
				if err != nil {
					return admin.PolicyResult{}, err
				}
				pc.Statement = st
				return c.SetPolicy(ctx, pc)
			}, renderPolicyResult)
		},
	}
	cmd.Flags().StringVar(&authorityKey, "authority-key", "", "the authority key `FILE`: sign the statement, so that it holds on every node")
	return cmd
}

// signRevocation signs, with the authority key in keyFile, that subject is
// revoked (on) or no longer revoked, with a serial above the one of the
// statement the agent holds about it (so it is the newest).
func signRevocation(ctx context.Context, c *admin.Client, keyFile, subject string, on bool) (string, error) {
	key, err := identity.LoadKey(keyFile)
	if err != nil {
		return "", fmt.Errorf("--authority-key: %w", err)
	}
	if _, _, err := identity.ParseRevocationSubject(subject); err != nil {
		return "", usageErrorf("%v", err)
	}
	ovs, err := c.Policy(ctx)
	if err != nil {
		return "", err
	}
	var held uint64
	for _, o := range ovs {
		if o.Kind != admin.KindSignedRevoke {
			continue
		}
		if r, err := identity.ParseRevocation(o.Statement); err == nil && r.Subject() == o.Node && sameSubject(o.Node, subject) {
			held = max(held, r.Serial)
		}
	}
	now := time.Now()
	r, err := identity.IssueRevocation(key, subject, on, identity.NextRevocationSerial(now, held), now)
	if err != nil {
		return "", err
	}
	return r.String(), nil
}

// sameSubject reports whether two subjects (names or base64 keys) are the
// same.
func sameSubject(a, b string) bool {
	an, ak, err1 := identity.ParseRevocationSubject(a)
	bn, bk, err2 := identity.ParseRevocationSubject(b)
	return err1 == nil && err2 == nil && an == bn && ak.Equal(bk)
}

func newPolicyCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "List or reset the run-time policy overrides",
		Long: `The config file is the baseline. Every run-time change (allow, deny,
serve-to, expose, unexpose, revoke) is stored as an override of that one fact,
kept across restarts and reloads, and applied on top of the config.
'policy reset' drops overrides, so the config decides again.`,
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "List the run-time overrides",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Policy, renderOverrides)
		},
	})
	var f admin.PolicyFilter
	reset := &cobra.Command{
		Use:   "reset",
		Short: "Drop run-time overrides (all, or those matching --kind, --role, --node)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.ResetResult, error) {
				return c.ResetPolicy(ctx, f)
			}, renderReset)
		},
	}
	reset.Flags().StringVar(&f.Kind, "kind", "", "only this kind: accept_from, serve_to, expose, revoke")
	reset.Flags().StringVar(&f.Role, "role", "", "only this role")
	reset.Flags().StringVar(&f.Node, "node", "", "only this node")
	cmd.AddCommand(reset)
	return cmd
}

func newKeyringCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "keyring",
		Short: "Rotate the gossip encryption keys across the cluster",
		Long: `'keyring rotate' makes a new key the only one on this node and on every
admitted peer, sent over the authenticated QUIC transport (never to a revoked
node); 'revoke' does it too. By hand, node by node: 'keyring install NEW',
wait until NEW is held by every node ('keyring list'), 'keyring use NEW',
then 'keyring remove OLD'. The primary key cannot be removed. Keys may be
named by their fingerprint for use and remove.

Keys are shown by fingerprint only: a secret key is never printed to a
terminal. 'keyring list --out FILE' writes the keys themselves to a new
keyring file (0600; a node's mesh.gossip_keyring), and 'keyring list
--print-keys' prints them when stdout is not a terminal (K=$(...)).`,
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "rotate",
		Short: "Make a new gossip key the only one on every admitted node (over QUIC)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.Keyring, error) {
				return c.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringRotate})
			}, renderKeyring)
		},
	})
	cmd.AddCommand(newKeyringListCmd(a))
	for _, op := range []struct{ op, short string }{
		{admin.KeyringInstall, "Install a key (base64, see 'keygen --gossip') for decryption on every node"},
		{admin.KeyringUse, "Make an installed key the primary (encrypting) key"},
		{admin.KeyringRemove, "Remove a key that is not the primary"},
	} {
		cmd.AddCommand(&cobra.Command{
			Use:   op.op + " KEY",
			Short: op.short,
			Args:  exactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.Keyring, error) {
					return c.ChangeKeyring(ctx, admin.KeyringChange{Op: op.op, Key: args[0]})
				}, renderKeyring)
			},
		})
	}
	return cmd
}

func newEventsCmd(a *app) *cobra.Command {
	var o admin.EventsOptions
	cmd := &cobra.Command{
		Use:   "events",
		Short: "Print the audit history (policy changes, refusals, joins, leaves); -f follows new events",
		Long: `events prints the agent's recent audit history (the last -n N events, or
all it keeps) and exits; with -f it then follows new events until
interrupted. With --json each event is one JSON object per line.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.Last < 0 {
				return usageErrorf("-n %d: want a count (0: all the history kept)", o.Last)
			}
			c := a.client()
			defer c.Close()
			return c.Events(cmd.Context(), o, func(e admin.Event) error {
				line := renderEvent(e)
				if a.json {
					b, err := json.Marshal(e)
					if err != nil {
						return err
					}
					line = string(b) + "\n"
				}
				_, err := fmt.Fprint(a.out, line)
				return err
			})
		},
	}
	cmd.Flags().IntVarP(&o.Last, "lines", "n", 0, "print the last N events of the history (0: all it keeps)")
	cmd.Flags().BoolVarP(&o.Follow, "follow", "f", false, "after the history, follow new events until interrupted")
	return cmd
}

func newReloadCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "reload",
		Short: "Re-read the config file (as SIGHUP does) and report what changed",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Reload, renderReload)
		},
	}
}

func newInstancesCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "instances",
		Short: "List the managed local instances",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) ([]admin.Instance, error) {
				is, err := c.Instances(ctx)
				if errors.Is(err, admin.ErrNotConfigured) { // no role has an instance: an empty list
					return []admin.Instance{}, nil
				}
				return is, err
			}, renderInstances)
		},
	}
	var n int
	var follow bool
	logs := &cobra.Command{
		Use:   "logs ROLE",
		Short: "Show the recent log lines of a role's instance; -f follows new lines",
		Long: `logs prints the last -n lines the agent keeps of ROLE's instance (its output,
and what the agent did with it) and exits; with -f it then prints new lines as
they come, until interrupted or the role has no instance any more (a retried
or respecified instance is followed on). With --json each line is one JSON
object per line.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !follow {
				return call(a, cmd, func(c *admin.Client, ctx context.Context) ([]admin.LogLine, error) {
					return c.InstanceLogs(ctx, args[0], n)
				}, renderLogs)
			}
			c := a.client()
			defer c.Close()
			err := c.FollowInstanceLogs(cmd.Context(), args[0], n, func(l admin.LogLine) error {
				line := renderLogs([]admin.LogLine{l})
				if a.json {
					b, err := json.Marshal(l)
					if err != nil {
						return err
					}
					line = string(b) + "\n"
				}
				_, err := fmt.Fprint(a.out, line)
				return err
			})
			if errors.Is(err, admin.ErrLogEnded) {
				// The instance went away: the log is over, as tail -f of
				// a removed file would not say but should.
				fmt.Fprintln(a.errOut, "infermesh:", err)
				return nil
			}
			return err
		},
	}
	logs.Flags().IntVarP(&n, "lines", "n", 100, "how many lines (0: all kept)")
	logs.Flags().BoolVarP(&follow, "follow", "f", false, "after the recent lines, follow new ones until interrupted")
	retry := &cobra.Command{
		Use:   "retry ROLE",
		Short: "Start a role's given-up instance again under a fresh restart policy",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.Instance, error) {
				return c.RetryInstance(ctx, args[0])
			}, func(i admin.Instance) string { return renderInstances([]admin.Instance{i}) })
		},
	}
	stop := &cobra.Command{
		Use:   "stop ROLE",
		Short: "Stop a role's instance and keep it stopped until 'instances retry' (instances outlive the agent otherwise)",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.Instance, error) {
				return c.StopInstance(ctx, args[0])
			}, func(i admin.Instance) string { return renderInstances([]admin.Instance{i}) })
		},
	}
	pull := &cobra.Command{
		Use:   "pull ROLE",
		Short: "Pull a docker instance's image now, with its progress (an instance's first start pulls a missing image too)",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := a.client()
			defer c.Close()
			return c.PullInstance(cmd.Context(), args[0], func(e admin.NodeEvent) error {
				if a.json {
					b, err := json.Marshal(e)
					if err != nil {
						return err
					}
					_, err = fmt.Fprintf(a.out, "%s\n", b)
					return err
				}
				var err error
				switch e.Kind {
				case admin.NodeEventLog:
					_, err = fmt.Fprintln(a.out, e.Line)
				case admin.NodeEventDone:
					_, err = fmt.Fprintln(a.out, e.Message)
				}
				return err
			})
		},
	}
	cmd.AddCommand(logs, retry, stop, pull)
	return cmd
}

func newMetricsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "metrics",
		Short: "Print the agent's Prometheus metrics (text format)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.json {
				return errors.New("metrics are in the Prometheus text format; --json does not apply")
			}
			c := a.client()
			defer c.Close()
			text, err := c.Metrics(cmd.Context())
			if err != nil {
				return err
			}
			_, err = fmt.Fprint(a.out, text)
			return err
		},
	}
}

// joinOr joins xs, or returns dash when there are none.
func joinOr(xs []string, dash string) string {
	if len(xs) == 0 {
		return dash
	}
	return strings.Join(xs, ", ")
}
