package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
	"golang.org/x/sys/unix"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

func init() { register(newNodeCmd) }

func newNodeCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Bring hosts into the mesh over SSH, list them, remove them",
		Long: `node add bootstraps a host into the mesh through this agent: a node
container on this host (--provider docker) or an existing server (--ssh).
The agent uploads itself, makes the node key on the host, issues its
admission certificate with the authority key, starts infermeshd under
systemd and waits until the node is admitted and its adverts arrive. Any
failure tears everything down again. node remove undoes an add.`,
	}
	cmd.AddCommand(newNodeAddCmd(a), newNodeListCmd(a), newNodeRemoveCmd(a))
	return cmd
}

type nodeAddFlags struct {
	provider, ssh, knownHosts, advertise, authorityKey, image, network string
	fingerprints, roles, upstreams, models, ports, verify              []string
	demo                                                               bool
	certTTL, joinTimeout                                               time.Duration
}

func newNodeAddCmd(a *app) *cobra.Command {
	var f nodeAddFlags
	cmd := &cobra.Command{
		Use:   "add NAME",
		Short: "Bootstrap a host into the mesh and wait until it joined",
		Long: `add brings a host into the mesh as node NAME and streams its stages and
bootstrap log (NDJSON with --json). It exits non-zero with the stage that
failed and why; everything it did is torn down again.

  infermesh node add gpu-7 --ssh root@10.0.0.7 --roles chat --upstream chat=http://127.0.0.1:8081 --authority-key authority.key
  infermesh node add lab-3 --provider docker --roles chat --demo --authority-key authority.key

The ssh host's key must be known: from your known_hosts (--known-hosts), or
--host-key-fingerprint SHA256:... checked out of band. The host must
authorize this agent's key (infermesh node list prints it) for root.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req, err := f.request(args[0])
			if err != nil {
				return err
			}
			c := a.client()
			defer c.Close()
			p := newNodeProgress(a)
			err = c.AddNode(cmd.Context(), req, p.event)
			return p.finish(args[0], "add", err)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.provider, "provider", "", "docker (a node container on the agent's host) or ssh (default with --ssh)")
	fl.StringVar(&f.ssh, "ssh", "", "the existing host: USER@HOST[:PORT]")
	fl.StringVar(&f.knownHosts, "known-hosts", "", "known_hosts file pinning the host's key (default ~/.ssh/known_hosts)")
	fl.StringSliceVar(&f.fingerprints, "host-key-fingerprint", nil, "pin the host's key by its SHA256 fingerprint (ssh-keygen -lf); repeatable")
	fl.StringVar(&f.advertise, "advertise", "", "the node's mesh address (an IP), when not its ssh host")
	fl.StringSliceVar(&f.roles, "roles", nil, "roles the node serves, comma-separated (required)")
	fl.StringArrayVar(&f.upstreams, "upstream", nil, "ROLE=URL: the role's instance on the node (http://127.0.0.1:PORT); repeatable")
	fl.StringArrayVar(&f.models, "model", nil, "ROLE=MODEL: the model the instance knows; repeatable")
	fl.StringArrayVar(&f.ports, "port", nil, "ROLE=PORT: the role's loopback port on the node (default 18080, 18081, ...); repeatable")
	fl.BoolVar(&f.demo, "demo", false, "install the demo model on the node as the upstream of roles without --upstream")
	fl.StringVar(&f.authorityKey, "authority-key", "", "the authority key file that signs the node's admission certificate (required)")
	fl.DurationVar(&f.certTTL, "cert-ttl", 720*time.Hour, "validity of the admission certificate")
	fl.StringArrayVar(&f.verify, "verify", nil, "a command that must exit 0 on the host before anything is installed; repeatable")
	fl.StringVar(&f.image, "image", "", "docker: the node image (default: the one make node-image builds)")
	fl.StringVar(&f.network, "network", "", "docker: the network the node container joins (default: the engine's bridge)")
	fl.DurationVar(&f.joinTimeout, "join-timeout", 3*time.Minute, "how long to wait for the node to join once its agent runs")
	_ = cmd.MarkFlagRequired("roles")
	_ = cmd.MarkFlagRequired("authority-key")
	return cmd
}

// request turns the flags into the admin request, reading the authority
// key and the pinned host keys here, where the operator's files are.
func (f *nodeAddFlags) request(name string) (admin.NodeAdd, error) {
	req := admin.NodeAdd{
		Name: name, Provider: f.provider, SSH: f.ssh, Advertise: f.advertise, Image: f.image, Network: f.network,
		Demo: f.demo, CertTTL: f.certTTL.Seconds(), JoinTimeout: f.joinTimeout.Seconds(), Verify: f.verify,
		HostKeyFingerprints: f.fingerprints,
	}
	switch {
	case req.Provider == "" && f.ssh != "":
		req.Provider = "ssh"
	case req.Provider == "":
		return req, errors.New("say where: --ssh USER@HOST, or --provider docker")
	}
	key, err := identity.LoadKey(f.authorityKey)
	if err != nil {
		return req, fmt.Errorf("--authority-key: %w", err)
	}
	req.AuthorityKey = base64.StdEncoding.EncodeToString(key.Seed())

	perRole := func(flag string, vals []string) (map[string]string, error) {
		out := map[string]string{}
		for _, v := range vals {
			k, val, ok := strings.Cut(v, "=")
			if !ok || k == "" || val == "" {
				return nil, fmt.Errorf("--%s %q: want ROLE=VALUE", flag, v)
			}
			out[k] = val
		}
		return out, nil
	}
	ups, err := perRole("upstream", f.upstreams)
	if err != nil {
		return req, err
	}
	models, err := perRole("model", f.models)
	if err != nil {
		return req, err
	}
	ports, err := perRole("port", f.ports)
	if err != nil {
		return req, err
	}
	known := map[string]bool{}
	for _, r := range f.roles {
		r = strings.TrimSpace(r)
		known[r] = true
		nr := admin.NodeRole{Name: r, Upstream: ups[r], Model: models[r]}
		if p, ok := ports[r]; ok {
			if nr.Port, err = strconv.Atoi(p); err != nil {
				return req, fmt.Errorf("--port %s=%s: not a number", r, p)
			}
		}
		req.Roles = append(req.Roles, nr)
	}
	for _, m := range []map[string]string{ups, models, ports} {
		for r := range m {
			if !known[r] {
				return req, fmt.Errorf("role %s is not in --roles", r)
			}
		}
	}

	if req.Provider == "ssh" && len(f.fingerprints) == 0 {
		keys, err := knownHostKeys(f.knownHosts, f.ssh)
		if err != nil {
			return req, err
		}
		req.HostKeys = keys
	}
	return req, nil
}

// knownHostKeys returns the keys file pins for the host of target
// (user@host[:port]), in authorized_keys format. A host it does not know
// is an error: the bootstrap never trusts a key on first use.
func knownHostKeys(file, target string) ([]string, error) {
	if file == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return nil, fmt.Errorf("known_hosts: %w (give --known-hosts or --host-key-fingerprint)", err)
		}
		file = filepath.Join(home, ".ssh", "known_hosts")
	}
	_, hostport, _ := strings.Cut(target, "@")
	host, port := hostport, "22"
	if h, p, err := net.SplitHostPort(hostport); err == nil {
		host, port = h, p
	}
	cb, err := knownhosts.New(file)
	if err != nil {
		return nil, fmt.Errorf("known_hosts: %w (give --known-hosts or --host-key-fingerprint)", err)
	}
	// Asking about a key no host has makes the callback list the keys it
	// knows for the host.
	_, probe, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	probePub, _ := ssh.NewPublicKey(probe.Public())
	remote := &net.TCPAddr{IP: net.ParseIP(host)}
	err = cb(net.JoinHostPort(host, port), remote, probePub)
	var ke *knownhosts.KeyError
	var re *knownhosts.RevokedError
	switch {
	case errors.As(err, &re):
		return nil, fmt.Errorf("known_hosts %s revokes a key of %s", file, host)
	case errors.As(err, &ke) && len(ke.Want) > 0:
		var out []string
		for _, k := range ke.Want {
			out = append(out, strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k.Key))))
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s is not in %s: verify its host key out of band and give --host-key-fingerprint SHA256:... (ssh-keyscan %s | ssh-keygen -lf -)", hostport, file, host)
}

func newNodeListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "list",
		Short: "List the nodes this agent added, their phase and their mesh membership",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return call(a, cmd, (*admin.Client).Nodes, renderNodes)
		},
	}
}

func newNodeRemoveCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "remove NAME",
		Short: "Tear a node down: its container removed, or what the bootstrap installed on its host undone",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := a.client()
			defer c.Close()
			p := newNodeProgress(a)
			err := c.RemoveNode(cmd.Context(), args[0], p.event)
			return p.finish(args[0], "remove", err)
		},
	}
}

func renderNodes(l admin.NodeList) string {
	rows := [][]string{{"NAME", "PROVIDER", "PHASE", "STAGE", "MEMBER", "ENDPOINT", "ROLES", "UPDATED"}}
	for _, n := range l.Nodes {
		phase := n.Phase
		if n.Busy != "" {
			phase += " (" + n.Busy + " running)"
		}
		rows = append(rows, []string{n.Name, n.Provider, phase, dash(n.Stage), dash(n.Member), dash(n.Endpoint), joinOr(n.Roles, "-"), fmtTime(n.Updated)})
	}
	var b strings.Builder
	if len(l.Nodes) == 0 {
		b.WriteString("no nodes\n")
	} else {
		b.WriteString(table(rows))
	}
	for _, n := range l.Nodes {
		if n.Failure != "" {
			fmt.Fprintf(&b, "%s: %s\n", n.Name, n.Failure)
		}
	}
	if l.BootstrapKey != "" {
		fmt.Fprintf(&b, "bootstrap key (authorize it on ssh hosts): %s\n", l.BootstrapKey)
	}
	return b.String()
}

// nodeProgress prints a node stream: NDJSON with --json, else one line per
// stage (its time in UTC, as every time the CLI prints) and the log lines
// indented, with colour on a terminal.
type nodeProgress struct {
	out  io.Writer
	json bool
	tty  bool
	last admin.NodeEvent
}

func newNodeProgress(a *app) *nodeProgress {
	return &nodeProgress{out: a.out, json: a.json, tty: isTerminal(a.out)}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

const (
	ansiDim   = "\x1b[2m"
	ansiBold  = "\x1b[1m"
	ansiRed   = "\x1b[31m"
	ansiGreen = "\x1b[32m"
	ansiReset = "\x1b[0m"
)

func (p *nodeProgress) paint(code, s string) string {
	if !p.tty {
		return s
	}
	return code + s + ansiReset
}

func (p *nodeProgress) event(e admin.NodeEvent) error {
	p.last = e
	if p.json {
		b, err := json.Marshal(e)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(p.out, "%s\n", b)
		return err
	}
	var line string
	switch e.Kind {
	case admin.NodeEventLog:
		line = p.paint(ansiDim, fmt.Sprintf("    %4d %s | %s", e.Seq, e.Stream, e.Line))
	case admin.NodeEventStage:
		// The session's stage while it runs (or just failed), else the
		// node's phase.
		where := e.Stage
		switch e.Phase {
		case "bootstrapping", "waiting_for_join", "converged", "failed":
		default:
			where = e.Phase
		}
		if where == "" {
			where = e.Phase
		}
		line = fmt.Sprintf("%s %s  %s", e.Time.UTC().Format("15:04:05"), p.paint(ansiBold, fmt.Sprintf("%-18s", where)), e.Message)
	case admin.NodeEventDone:
		line = fmt.Sprintf("%s %s  %s", e.Time.UTC().Format("15:04:05"), p.paint(ansiGreen, fmt.Sprintf("%-18s", "done")), e.Message)
	case admin.NodeEventFailed:
		line = fmt.Sprintf("%s %s  %s", e.Time.UTC().Format("15:04:05"), p.paint(ansiRed, fmt.Sprintf("%-18s", "failed")), e.Message)
	default:
		return nil
	}
	_, err := fmt.Fprintln(p.out, line)
	return err
}

// finish turns the stream's end into the command's result: nil, or an
// error naming the node, the stage that failed and why.
func (p *nodeProgress) finish(name, op string, err error) error {
	var nf *admin.NodeFailedError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.Canceled) && op == "add":
		return fmt.Errorf("node %s: add interrupted; the agent tears down what it did", name)
	case errors.Is(err, context.Canceled):
		return fmt.Errorf("node %s: %s interrupted; the agent finishes it (infermesh node list)", name, op)
	case errors.As(err, &nf):
		stage := nf.Stage
		if stage == "" {
			stage = p.last.Stage
		}
		if stage == "" {
			stage = p.last.Phase
		}
		return fmt.Errorf("node %s: %s failed at stage %s: %s", name, op, dash(stage), nf.Message)
	default:
		return fmt.Errorf("node %s: %s: %w", name, op, err)
	}
}
