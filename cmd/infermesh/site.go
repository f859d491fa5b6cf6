package main

import (
	"github.com/infermesh/infermesh/config"

	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/provision"
)

// The stopped-site commands: `infermesh site inventory|cleanup|reset|delete`
// and `infermesh node leave`. They work offline, on a stopped agent: they
// read the agent's config file, refuse while the agent runs (it answers on
// its admin socket, or holds the state store's lock), and hold the state
// store's exclusive lock while they run, so the agent cannot start under
// them.

// removeContentsCmd is the hidden command the root-owned data helper
// container runs (provision.SiteCleanupsConfig.Helper).
const removeContentsCmd = "__remove-contents"

func init() {
	register(newSiteCmd)
	register(newRemoveContentsCmd)
	registerSub("node", newNodeLeaveCmd)
}

// siteFlags are what every stopped-site command takes.
type siteFlags struct {
	config   string
	site     string
	node     string
	stateDir string
	cacheDir string
	dryRun   bool
}

func (f *siteFlags) add(cmd *cobra.Command, dryRun bool) {
	cmd.Flags().StringVar(&f.config, "config", config.DefaultFile, "the agent's config file")
	cmd.Flags().StringVar(&f.site, "site", "", "the site (default: the config's; required when the config cannot be read)")
	cmd.Flags().StringVar(&f.node, "node", "", "this node's name (default: the config's, else the host name)")
	cmd.Flags().StringVar(&f.stateDir, "state-dir", "", "the agent's state dir (default: the config's node.state_dir)")
	cmd.Flags().StringVar(&f.cacheDir, "cache-dir", "", "the workload cache root (default: the config's node.cache_dir)")
	if dryRun {
		cmd.Flags().BoolVar(&f.dryRun, "dry-run", false, "find and report, remove nothing")
	}
}

func newSiteCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "site",
		Short: "Inventory and clean up this host's resources of a stopped site (the agent must be stopped)",
	}
	var inv siteFlags
	var invTargets []string
	inventory := &cobra.Command{
		Use:   "inventory",
		Short: "List the site's runtime resources on this host (containers, native processes), changing nothing",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			scope, err := scopeOf(invTargets)
			if err != nil {
				return err
			}
			return withSite(cmd.Context(), a, inv, false, func(ctx context.Context, s *cleanup.Site) error {
				res, err := s.Inventory(ctx, scope)
				if err != nil {
					return err
				}
				return a.print(res, renderInventory(s, scope, res))
			})
		},
	}
	inv.add(inventory, false)
	inventory.Flags().StringSliceVar(&invTargets, "targets", nil, "only these execution targets (nodes), comma-separated")

	var cl siteFlags
	var clTargets []string
	clean := &cobra.Command{
		Use:   "cleanup",
		Short: "Ensure the site's runtime resources on this host are absent (every node's, or --targets')",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			scope, err := scopeOf(clTargets)
			if err != nil {
				return err
			}
			return runOutcome(cmd.Context(), a, cl, func(s *cleanup.Site, ctx context.Context, dryRun bool) (cleanup.Outcome, error) {
				return s.Cleanup(ctx, scope, dryRun)
			})
		},
	}
	cl.add(clean, true)
	clean.Flags().StringSliceVar(&clTargets, "targets", nil, "only these execution targets (nodes), comma-separated")

	var rs siteFlags
	reset := &cobra.Command{
		Use:   "reset",
		Short: "Remove every runtime resource of the site on this host and forget its intents; keep its data and caches",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runOutcome(cmd.Context(), a, rs, (*cleanup.Site).Reset)
		},
	}
	rs.add(reset, true)

	var dl siteFlags
	del := &cobra.Command{
		Use:   "delete",
		Short: "Reset, then remove the site's directory and its workload caches on this host",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runOutcome(cmd.Context(), a, dl, (*cleanup.Site).Delete)
		},
	}
	dl.add(del, true)
	cmd.AddCommand(inventory, clean, reset, del)
	return cmd
}

func newNodeLeaveCmd(a *app) *cobra.Command {
	var f siteFlags
	cmd := &cobra.Command{
		Use:   "leave",
		Short: "This node leaves its site: remove its resources, node folder and caches (cleanup with scope targets <this node>)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runOutcome(cmd.Context(), a, f, (*cleanup.Site).Leave)
		},
	}
	f.add(cmd, true)
	return cmd
}

func newRemoveContentsCmd(*app) *cobra.Command {
	return &cobra.Command{
		Use:    removeContentsCmd + " DIR",
		Short:  "Remove everything inside DIR (run by site delete's helper container)",
		Hidden: true,
		Args:   exactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return provision.RemoveContents(args[0])
		},
	}
}

func scopeOf(targets []string) (cleanup.Scope, error) {
	if len(targets) == 0 {
		return cleanup.SiteScope(), nil
	}
	return cleanup.TargetScope(targets...)
}

// runOutcome runs one removing operation and prints its outcome, also when
// it failed part way (what it found and did until then), then the error.
func runOutcome(ctx context.Context, a *app, f siteFlags, op func(*cleanup.Site, context.Context, bool) (cleanup.Outcome, error)) error {
	return withSite(ctx, a, f, true, func(ctx context.Context, s *cleanup.Site) error {
		out, err := op(s, ctx, f.dryRun)
		if out.Operation != "" {
			if perr := a.print(out, renderOutcome(out)); perr != nil {
				return perr
			}
		}
		return err
	})
}

// withSite reads the config, refuses unless the agent is stopped, takes
// the state store's lock (exclusive; for a read-only pass, only when the
// store exists) and runs fn with the site's operations.
func withSite(ctx context.Context, a *app, f siteFlags, mutating bool, fn func(context.Context, *cleanup.Site) error) error {
	cfg, rerr := cleanup.ReadSiteConfig(f.config)
	kinds, err := cleanup.SelectKinds(cfg, rerr)
	if err != nil {
		return err // an unknown binding: before any runtime is contacted
	}
	if rerr != nil {
		if f.site == "" {
			return fmt.Errorf("%w; name the site with --site (every runtime is then bound: none may be skipped)", rerr)
		}
		cfg = cleanup.SiteConfig{Site: f.site, Node: f.node, StateDir: f.stateDir, CacheRoot: f.cacheDir}
		fmt.Fprintf(a.errOut, "infermesh: %v; cleaning up site %s with every runtime bound\n", rerr, f.site)
		if err := fillSiteDefaults(&cfg); err != nil {
			return err
		}
	}
	for _, o := range []struct {
		dst *string
		v   string
	}{{&cfg.Site, f.site}, {&cfg.Node, f.node}, {&cfg.StateDir, f.stateDir}, {&cfg.CacheRoot, f.cacheDir}} {
		if o.v != "" {
			*o.dst = o.v
		}
	}
	layout := cfg.Layout()
	if err := layout.Validate(); err != nil {
		return err
	}
	if cfg.AdminSocket != "" && agentAnswers(cfg.AdminSocket) {
		return fmt.Errorf("%w: it answers on %s: stop it first (systemctl stop infermeshd)", cleanup.ErrSiteRunning, cfg.AdminSocket)
	}
	lock, err := cleanup.LockStore(cfg.StateDir, time.Second, mutating)
	if err != nil {
		return err
	}
	if lock != nil {
		defer lock.Close()
	}
	cli, err := provision.NewDockerClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	helper, _ := os.Executable()
	backends, err := provision.NewSiteCleanups(provision.SiteCleanupsConfig{
		Docker: cli, Layout: layout, Node: cfg.Node, Helper: helper, HelperArgs: []string{removeContentsCmd},
	})
	if err != nil {
		return err
	}
	return fn(ctx, &cleanup.Site{Name: cfg.Site, Node: cfg.Node, Layout: layout, Bound: kinds, Backends: backends, Lock: lock})
}

// fillSiteDefaults gives a site named on the command line the agent's
// defaults, as a config would.
func fillSiteDefaults(c *cleanup.SiteConfig) error {
	data, err := json.Marshal(map[string]any{
		"site": c.Site,
		"node": map[string]string{"name": c.Node, "state_dir": c.StateDir, "cache_dir": c.CacheRoot},
	})
	if err != nil {
		return err
	}
	parsed, err := cleanup.ParseSiteConfig(data) // JSON is YAML
	if err != nil {
		return err
	}
	*c = parsed
	return nil
}

// agentAnswers reports whether something accepts connections on the admin
// socket: a running agent. A stale socket file refuses.
func agentAnswers(path string) bool {
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func renderResources(b *strings.Builder, rs []cleanup.Resource, indent string) {
	last := ""
	for _, r := range rs {
		if r.Runtime != last {
			fmt.Fprintf(b, "%s%s:\n", indent, r.Runtime)
			last = r.Runtime
		}
		fmt.Fprintf(b, "%s  %s\n", indent, r.Description)
	}
}

func renderSkipped(b *strings.Builder, sk []cleanup.Skipped) {
	for _, s := range sk {
		fmt.Fprintf(b, "skipped %s (optional, unreachable): %v\n", s.Runtime, s.Reason)
	}
}

func renderInventory(s *cleanup.Site, scope cleanup.Scope, inv cleanup.Inventory) string {
	var b strings.Builder
	fmt.Fprintf(&b, "site %s on node %s, scope %s\n", s.Name, s.Node, scope)
	if len(inv.Resources) == 0 {
		b.WriteString("no runtime resources\n")
	}
	renderResources(&b, inv.Resources, "")
	renderSkipped(&b, inv.Skipped)
	return strings.TrimSuffix(b.String(), "\n")
}

func renderOutcome(o cleanup.Outcome) string {
	var b strings.Builder
	fmt.Fprintf(&b, "site %s on node %s: %s, scope %s", o.Site, o.Node, o.Operation, o.Scope)
	if o.DryRun {
		b.WriteString(" (dry run: nothing is removed)")
	}
	b.WriteString("\n")
	if len(o.Found) == 0 {
		b.WriteString("found no runtime resources\n")
	} else {
		b.WriteString("found:\n")
		renderResources(&b, o.Found, "  ")
	}
	renderSkipped(&b, o.Skipped)
	if !o.DryRun {
		if len(o.Removed) > 0 {
			b.WriteString("removed:\n")
			renderResources(&b, o.Removed, "  ")
		}
		if o.Intents > 0 {
			fmt.Fprintf(&b, "forgot %d intent(s)\n", o.Intents)
		}
		for _, p := range o.Paths {
			switch {
			case p.Absent:
				fmt.Fprintf(&b, "%s %s: already absent\n", p.What, p.Path)
			case p.RootOwned:
				fmt.Fprintf(&b, "removed %s %s (its root-owned data through a helper container)\n", p.What, p.Path)
			default:
				fmt.Fprintf(&b, "removed %s %s\n", p.What, p.Path)
			}
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}
