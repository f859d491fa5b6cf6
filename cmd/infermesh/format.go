package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

// Human output. Every renderer is a pure function of the answer, so the
// golden tests pin the layout.

// table renders rows (the first is the header) with tabwriter.
func table(rows [][]string) string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	_ = tw.Flush()
	return b.String()
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func fmtSeconds(s float64) string {
	d := time.Duration(s * float64(time.Second))
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

func renderStatus(s admin.Status) string {
	mesh := s.Mesh.State
	if s.Mesh.State != "disabled" {
		mesh = fmt.Sprintf("%s: %d member(s), %d admitted, gossip %s", s.Mesh.State, s.Mesh.Members, s.Mesh.Admitted, s.Mesh.GossipAddr)
	}
	var remote []string
	for _, r := range s.RemoteRoles {
		remote = append(remote, r.Role+" via "+strings.Join(r.Nodes, ", "))
	}
	cfg := s.Config
	if cfg == "" {
		cfg = "(built in)"
	}
	return table([][]string{
		{"node", s.Node},
		{"version", s.Version},
		{"started", fmtTime(s.Started)},
		{"uptime", fmtSeconds(s.UptimeSeconds)},
		{"config", cfg},
		{"generation", strconv.FormatUint(s.Generation, 10)},
		{"mesh", mesh},
		{"local roles", joinOr(s.LocalRoles, "-")},
		{"remote roles", strings.Join(orDash(remote), "; ")},
		{"overrides", strconv.Itoa(s.Overrides)},
	})
}

func orDash(xs []string) []string {
	if len(xs) == 0 {
		return []string{"-"}
	}
	return xs
}

func renderPeers(ps []admin.Peer) string {
	rows := [][]string{{"NAME", "STATE", "SCOPE", "GOSSIP", "QUIC", "ROLES", "WHY"}}
	var refused [][]string
	for _, p := range ps {
		if p.State == admin.PeerRefused {
			seen := "-"
			if p.LastSeen != nil {
				seen = fmtTime(*p.LastSeen)
			}
			refused = append(refused, []string{p.Name, dash(p.Why), dash(p.GossipAddr), dash(p.PublicKey), seen})
			continue
		}
		rows = append(rows, []string{
			p.Name, p.State, dash(p.Scope), dash(p.GossipAddr), dash(p.QUICAddr), joinOr(p.Roles, "-"), dash(p.Why),
		})
	}
	out := table(rows)
	if len(refused) > 0 {
		out += "\nrefused (never members):\n" + table(append([][]string{{"NAME", "WHY", "GOSSIP", "KEY PRESENTED", "LAST SEEN"}}, refused...))
	}
	return out
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// ruleText shows one rule: "b" from the config, "c (runtime)" added at run
// time, "-c (runtime)" removed at run time.
func ruleText(r admin.Rule) string {
	s := r.Node
	if !r.On {
		s = "-" + s
	}
	if r.Source == admin.SourceRuntime {
		s += " (runtime)"
	}
	return s
}

func rulesText(rs []admin.Rule) string {
	var out []string
	for _, r := range rs {
		out = append(out, ruleText(r))
	}
	return joinOr(out, "-")
}

func renderRoles(rs []admin.Role) string {
	rows := [][]string{{"ROLE", "ADDR", "LOCAL", "EXPOSED", "SERVE TO", "ACCEPT FROM", "REMOTES"}}
	for _, r := range rs {
		local := "-"
		if r.Local != nil {
			local = r.Local.Base
			if r.Local.Model != "" {
				local += " (" + r.Local.Model + ")"
			}
		}
		exposed := "no"
		if r.Expose.On {
			exposed = "yes"
		}
		exposed += " (" + r.Expose.Source + ")"
		var remotes []string
		for _, ad := range r.Remotes {
			state := fmt.Sprintf("load %d, %s", ad.Load, fmtSeconds(ad.AgeSeconds))
			if !ad.Fresh {
				state = "stale, " + fmtSeconds(ad.AgeSeconds)
			}
			remotes = append(remotes, ad.Node+" ("+state+")")
		}
		rows = append(rows, []string{
			r.Name, dash(r.Addr), local, exposed, rulesText(r.ServeTo), rulesText(r.AcceptFrom), joinOr(remotes, "-"),
		})
	}
	return table(rows)
}

func renderRoute(rt admin.Route) string {
	var b strings.Builder
	if rt.Serving != "" {
		fmt.Fprintf(&b, "role %s is served by %s (generation %d)\n", rt.Role, rt.Serving, rt.Generation)
	} else {
		fmt.Fprintf(&b, "role %s: no node serves it now (generation %d)\n", rt.Role, rt.Generation)
	}
	if rt.Queue > 0 {
		fmt.Fprintf(&b, "%d waiting here for a free slot\n", rt.Queue)
	}
	if rt.CacheHitRatio != nil {
		fmt.Fprintf(&b, "local instance's prefix cache hit ratio %.2f (recent minutes)\n", *rt.CacheHitRatio)
	}
	rows := [][]string{{"RANK", "NODE", "KIND", "MODEL", "LOAD", "CAPACITY", "ADVERT", "WHY NOT / NOTES"}}
	for _, d := range rt.Decisions {
		rank := "-"
		if d.Candidate {
			rank = strconv.Itoa(d.Rank)
		}
		advert := "-"
		if d.HasAdvert {
			advert = fmtSeconds(d.AgeSeconds) + " old"
		}
		load := "-"
		if d.Candidate || d.HasAdvert {
			load = strconv.FormatUint(uint64(d.Load), 10)
		}
		why := strings.Join(d.Reasons, "; ")
		if d.Candidate {
			why = strings.Join(d.Notes, "; ")
		}
		capacity := strings.TrimPrefix(capacityText(d.Capacity), ", ")
		rows = append(rows, []string{rank, d.Node, d.Kind, dash(d.Model), load, dash(capacity), advert, dash(why)})
	}
	b.WriteString(table(rows))
	for _, h := range rt.Hints {
		fmt.Fprintf(&b, "hint: %s\n", h)
	}
	return b.String()
}

func overrideText(o admin.Override) string {
	switch o.Kind {
	case admin.KindExpose:
		if o.On {
			return "expose " + o.Role
		}
		return "unexpose " + o.Role
	case admin.KindRevoke:
		if o.On {
			return "revoke " + o.Node
		}
		return "unrevoke " + o.Node
	case admin.KindSignedRevoke:
		what := "unrevoke " + o.Node
		if o.On {
			what = "revoke " + o.Node
		}
		if r, err := identity.ParseRevocation(o.Statement); err == nil {
			return fmt.Sprintf("%s, signed by the authority (serial %d, issued %s)", what, r.Serial, fmtTime(r.IssuedAt))
		}
		return what + ", signed by the authority"
	case admin.KindServeTo:
		if o.On {
			return fmt.Sprintf("serve %s to %s", o.Role, o.Node)
		}
		return fmt.Sprintf("do not serve %s to %s", o.Role, o.Node)
	case admin.KindAcceptFrom:
		if o.On {
			return fmt.Sprintf("allow %s to serve %s", o.Node, o.Role)
		}
		return fmt.Sprintf("deny %s serving %s", o.Node, o.Role)
	}
	return fmt.Sprintf("%s %s %s %v", o.Kind, o.Role, o.Node, o.On)
}

func renderPolicyResult(r admin.PolicyResult) string {
	var b strings.Builder
	b.WriteString(overrideText(r.Override))
	if r.Changed {
		b.WriteString(": done\n")
	} else {
		b.WriteString(": already in force\n")
	}
	if r.Note != "" {
		b.WriteString("note: " + r.Note + "\n")
	}
	return b.String()
}

func renderOverrides(os []admin.Override) string {
	if len(os) == 0 {
		return "no run-time overrides: the config file decides\n"
	}
	rows := [][]string{{"KIND", "ROLE", "NODE", "ON", "OVERRIDE", "BY", "AT"}}
	for _, o := range os {
		what := overrideText(o)
		if !o.Active {
			what += " (inactive: role not in the config)"
		}
		rows = append(rows, []string{o.Kind, dash(o.Role), dash(o.Node), strconv.FormatBool(o.On), what, dash(o.By), fmtTime(o.At)})
	}
	return table(rows)
}

func renderReset(r admin.ResetResult) string {
	if len(r.Removed) == 0 {
		return "no override matched; nothing changed\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "removed %d override(s); the config decides again:\n", len(r.Removed))
	for _, o := range r.Removed {
		b.WriteString("  " + overrideText(o) + "\n")
	}
	return b.String()
}

func renderKeyring(k admin.Keyring) string {
	// Fingerprints only: the keys themselves never go to a terminal
	// (keyring list --out or --print-keys).
	rows := [][]string{{"FINGERPRINT", "PRIMARY", "NODES"}}
	for _, g := range k.Keys {
		primary := ""
		if g.Primary {
			primary = "yes"
		}
		rows = append(rows, []string{g.Fingerprint, dash(primary), fmt.Sprintf("%d/%d", g.Nodes, k.Members)})
	}
	if k.Note != "" {
		return k.Note + "\n" + table(rows)
	}
	return table(rows)
}

func renderEvent(e admin.Event) string {
	parts := []string{fmtTime(e.Time), e.Kind}
	if e.Role != "" {
		parts = append(parts, "role="+e.Role)
	}
	if e.Node != "" {
		parts = append(parts, "node="+e.Node)
	}
	keys := make([]string, 0, len(e.Fields))
	for k := range e.Fields {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		v := e.Fields[k]
		if strings.ContainsAny(v, " \t\"=") {
			v = strconv.Quote(v)
		}
		parts = append(parts, k+"="+v)
	}
	return strings.Join(parts, " ") + "\n"
}

func renderReload(r admin.ReloadResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "reloaded %s (generation %d)\n", r.Config, r.Generation)
	if len(r.Applied) == 0 && len(r.NeedsRestart) == 0 {
		b.WriteString("nothing changed\n")
		return b.String()
	}
	if len(r.Applied) > 0 {
		b.WriteString("applied:\n")
		for _, s := range r.Applied {
			b.WriteString("  " + s + "\n")
		}
	}
	if len(r.NeedsRestart) > 0 {
		b.WriteString("needs a restart to take effect:\n")
		for _, s := range r.NeedsRestart {
			b.WriteString("  " + s + "\n")
		}
	}
	return b.String()
}

func renderInstances(is []admin.Instance) string {
	if len(is) == 0 {
		return "no managed instances\n"
	}
	rows := [][]string{{"ROLE", "STATE", "IMAGE", "ENDPOINT", "RESTARTS", "SINCE", "CONTAINER", "LAST ERROR"}}
	for _, i := range is {
		rows = append(rows, []string{i.Role, i.State, dash(i.Image), dash(i.Endpoint), strconv.Itoa(i.Restarts), fmtTime(i.Since), dash(i.Ref), dash(i.LastError)})
	}
	return table(rows)
}

func renderLogs(ls []admin.LogLine) string {
	var b strings.Builder
	for _, l := range ls {
		fmt.Fprintf(&b, "%s %s %s\n", fmtTime(l.Time), l.Stream, l.Line)
	}
	return b.String()
}

// renderRouteDecision prints one request's route decision: the reason,
// then a row per candidate in the order they were to be tried.
func renderRouteDecision(d admin.RouteDecision) string {
	var b strings.Builder
	fmt.Fprintf(&b, "request %s (role %s): %s, policy %s, reason %s\n", d.ID, d.Role, routeOutcome(d), d.Policy, d.Reason)
	fmt.Fprintf(&b, "prompt ~%d tokens, affinity key: %s", d.Tokens, d.Key)
	if d.QueuedMillis > 0 {
		fmt.Fprintf(&b, ", queued %.1fms", d.QueuedMillis)
	}
	b.WriteString("\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CANDIDATE\tESTIMATE\tQUEUE\tPREFILL\tNETWORK\tCACHED\tLOAD\t")
	for _, c := range d.Candidates {
		var marks []string
		if c.Affine {
			marks = append(marks, "(affine)")
		}
		if c.Target == d.Target {
			marks = append(marks, "<- answered")
		}
		mark := strings.Join(marks, " ")
		slots := "?"
		if c.Slots > 0 {
			slots = fmt.Sprint(c.Slots)
		}
		if !c.Estimated {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t%d/%s\t%s\n", c.Target, c.InFlight, slots, mark)
			continue
		}
		est := fmt.Sprintf("%.1fms", c.EstimateMillis)
		if c.PenaltyMillis > 0 {
			est += " (penalized)"
		}
		full := ""
		if c.Full {
			full = " full"
		}
		fmt.Fprintf(tw, "%s\t%s\t%.1fms\t%.1fms\t%.1fms\t%d\t%d/%s%s\t%s\n", c.Target, est, c.QueueMillis, c.PrefillMillis,
			c.NetworkMillis, c.CachedTokens, c.InFlight, slots, full, mark)
	}
	_ = tw.Flush()
	return b.String()
}

func routeOutcome(d admin.RouteDecision) string {
	if d.Target == "" {
		return fmt.Sprintf("no candidate answered (status %d)", d.Status)
	}
	return fmt.Sprintf("served by %s (status %d)", d.Target, d.Status)
}
