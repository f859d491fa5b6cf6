package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
)

// The whole mesh from this node: `infermesh mesh`.

func init() {
	register(newMeshCmd)
}

func newMeshCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "mesh",
		Short: "List every node this agent knows: roles and whether each serves them to us, load, version, certificate expiry, last heard, RTT",
		Long: `mesh shows the whole mesh as this node sees it. For each node: its state and
scope; the roles it serves from an instance of its own, whether it is a
candidate for each here (and why not), and their load; its version and when
it started; when its admission certificate expires; when gossip last heard
it; and the round-trip time of gossip's probes to it.

The version and the current in-flight counts come from a small read-only info
call over QUIC to admitted peers (answers are reused for 5s); nodes that are
not admitted are never asked. A peer that does not answer shows why under
INFO.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.MeshView, error) {
				return c.MeshView(ctx)
			}, func(v admin.MeshView) string { return renderMeshView(v, now()) })
		},
	}
}

// now is the clock relative times are shown against (a test's fixed
// one in the golden tests).
var now = time.Now

// renderMeshView is the mesh view as a table, times relative to now.
func renderMeshView(v admin.MeshView, now time.Time) string {
	rows := [][]string{{"NODE", "STATE", "SCOPE", "VERSION", "RTT", "HEARD", "CERT EXPIRES", "ROLES"}}
	var notes []string
	for _, n := range v.Nodes {
		name := n.Name
		if n.State == admin.PeerSelf {
			name += " (this node)"
		}
		rtt := "-"
		if n.RTTMillis > 0 {
			rtt = fmt.Sprintf("%.2fms", n.RTTMillis)
		}
		heard := "-"
		if n.LastHeard != nil {
			heard = ago(now.Sub(*n.LastHeard))
		}
		expires := "-"
		if n.CertExpires != nil {
			if d := n.CertExpires.Sub(now); d > 0 {
				expires = "in " + roughDuration(d)
			} else {
				expires = "EXPIRED " + ago(-d)
			}
		}
		var roles []string
		for _, r := range n.Roles {
			roles = append(roles, meshRoleText(n.State == admin.PeerSelf, r))
		}
		rows = append(rows, []string{name, n.State, dash(n.Scope), dash(n.Version), rtt, heard, expires, joinOr(roles, "-")})
		if n.Why != "" {
			notes = append(notes, fmt.Sprintf("%s: %s", n.Name, n.Why))
		}
		if n.InfoError != "" {
			notes = append(notes, fmt.Sprintf("%s: no info: %s", n.Name, n.InfoError))
		}
	}
	out := table(rows)
	if len(notes) > 0 {
		out += "\n" + strings.Join(notes, "\n") + "\n"
	}
	return out
}

// meshRoleText is one role of a node: "chat (serves us, load 2)", or why
// it does not serve us: "chat (not: not_allowlisted, load 0)".
func meshRoleText(self bool, r admin.MeshRole) string {
	load := r.Load
	if r.InFlight != nil {
		load = *r.InFlight
	}
	state := "serves us"
	switch {
	case self && r.ServesUs:
		state = "local"
	case !r.ServesUs && len(r.Why) > 0:
		state = "not: " + strings.Join(r.Why, ",")
	case !r.ServesUs:
		state = "not a candidate"
	}
	return fmt.Sprintf("%s (%s, load %d%s)", r.Name, state, load, capacityText(r.Capacity))
}

// capacityText is an instance's capacity as ", 2/4 slots, 1 queued, kv
// 42%, cache hit 73%" (what is known of it), "" when nothing is.
func capacityText(c *admin.Capacity) string {
	if c == nil {
		return ""
	}
	s := ""
	if c.Slots > 0 {
		s += fmt.Sprintf(", %d/%d slots", c.Running, c.Slots)
	} else {
		s += fmt.Sprintf(", %d running", c.Running)
	}
	if c.Waiting > 0 {
		s += fmt.Sprintf(", %d queued", c.Waiting)
	}
	if c.KVUsage > 0 {
		s += fmt.Sprintf(", kv %d%%", int(c.KVUsage*100+0.5))
	}
	if c.CacheHitRatio != nil {
		s += fmt.Sprintf(", cache hit %d%%", int(*c.CacheHitRatio*100+0.5))
	}
	return s
}

// ago is d as "3s ago", coarser as it grows.
func ago(d time.Duration) string {
	if d < time.Second {
		return "now"
	}
	return roughDuration(d) + " ago"
}

// roughDuration is d to its largest unit or two: 45s, 3m10s, 5h2m, 29d4h.
func roughDuration(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

func init() {
	register(newConsoleCmd)
}

func newConsoleCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "console",
		Short: "Print the web console's URL, with the token the agent made at its start",
		Long: `console prints the URL of the agent's read-only web console (admin.console,
off by default), with the token it made at its start (kept in
<state_dir>/console.token, mode 0600, replaced at every start). Open it in a
browser on this host: the first visit trades the token for a cookie. The
console answers loopback only and refuses other sites' pages.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.ConsoleInfo, error) {
				return c.Console(ctx)
			}, func(ci admin.ConsoleInfo) string { return ci.URL + "\n" })
		},
	}
}
