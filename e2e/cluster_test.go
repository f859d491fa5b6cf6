//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/configs"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/internal/testing/nodetest"
	"github.com/infermesh/infermesh/internal/testing/testbin"
)

const labelRun = "io.infermesh.e2e"

var (
	runID  = fmt.Sprintf("%06x", time.Now().UnixNano()&0xffffff)
	prefix = "infermesh-e2e-faults-" + runID
)

func TestMain(m *testing.M) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-sig
		fmt.Fprintf(os.Stderr, "e2e: %v: tearing the cluster down\n", s)
		teardown()
		os.Exit(130)
	}()
	code := m.Run()
	teardown()
	if left := leftovers(); left != "" {
		fmt.Fprintf(os.Stderr, "e2e: left behind after teardown:\n%s\n", left)
		code = 1
	}
	os.Exit(code)
}

// leftovers lists what this run created and still exists.
func leftovers() string {
	ctrs, err1 := docker(context.Background(), "ps", "-a", "--format", "{{.Names}}", "--filter", "label="+labelRun+"="+runID)
	nets, err2 := docker(context.Background(), "network", "ls", "--format", "{{.Name}}", "--filter", "label="+labelRun+"="+runID)
	if err1 != nil || err2 != nil {
		return fmt.Sprint(err1, err2)
	}
	return strings.TrimSpace(ctrs + "\n" + nets)
}

// teardown removes every container and network of this run, whatever a
// test left behind.
func teardown() {
	ids, _ := docker(context.Background(), "ps", "-aq", "--filter", "label="+labelRun+"="+runID)
	if f := strings.Fields(ids); len(f) > 0 {
		_, _ = docker(context.Background(), append([]string{"rm", "-f", "-v"}, f...)...)
	}
	nets, _ := docker(context.Background(), "network", "ls", "-q", "--filter", "label="+labelRun+"="+runID)
	if f := strings.Fields(nets); len(f) > 0 {
		_, _ = docker(context.Background(), append([]string{"network", "rm"}, f...)...)
	}
}

// docker runs the docker CLI: faults are what an operator's shell does.
func docker(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	cmd := exec.CommandContext(ctx, "docker", args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("docker %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

type host struct {
	name  string
	ctr   string // container name
	ip    string
	pub   string
	serve bool // serves chat (h1..); h0 is the application host
}

type cluster struct {
	t     *testing.T
	api   nodeimage.ContainerAPI
	net   string
	hosts []*host
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// newCluster boots n systemd hosts, installs infermeshd on each (the unit
// of configs/, unchanged) and waits until the mesh is whole.
func newCluster(t *testing.T, n int) *cluster {
	t.Helper()
	cli, tag := nodetest.Setup(t)
	t.Cleanup(teardown)
	ctx := context.Background()
	tmp := t.TempDir()
	bins, err := testbin.Build(tmp, "./cmd/infermeshd", "./cmd/infermesh", "./cmd/infermesh-demo", "./e2e/cmd/e2eload")
	if err != nil {
		t.Fatal(err)
	}
	root, err := testbin.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	unit, err := os.ReadFile(filepath.Join(root, "configs", "infermeshd.service"))
	if err != nil {
		t.Fatal(err)
	}

	// A network with a subnet of its own, so a host reconnected after a
	// partition gets its address back.
	c := &cluster{t: t, api: cli, net: prefix}
	var netErr error
	for i := range 20 {
		subnet := fmt.Sprintf("10.%d.%d.0/24", 200+i%50, (int(time.Now().UnixNano()>>8)+i*7)%250)
		_, netErr = docker(ctx, "network", "create", "--label", labelRun+"="+runID, "--subnet", subnet, c.net)
		if netErr == nil {
			break
		}
	}
	if netErr != nil {
		t.Fatal(netErr)
	}

	keyring := filepath.Join(tmp, "keyring.json")
	if _, err := identity.WriteNewKeyring(keyring); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		h := &host{name: fmt.Sprintf("h%d", i), serve: i > 0}
		h.ctr = prefix + "-" + h.name
		c.hosts = append(c.hosts, h)
		_, hostKey, _ := ed25519.GenerateKey(rand.Reader)
		if _, err := nodeimage.Boot(ctx, cli, nodeimage.BootOptions{
			Tag: tag, Name: h.ctr, Network: c.net, HostKey: hostKey,
			Labels: map[string]string{labelRun: runID},
		}); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			_, errs[i] = nodeimage.WaitReady(rctx, cli, h.ctr)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, h := range c.hosts {
		if h.ip, err = docker(ctx, "inspect", "-f", `{{(index .NetworkSettings.Networks "`+c.net+`").IPAddress}}`, h.ctr); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(tmp, h.name)
		if err := os.MkdirAll(filepath.Join(dir, "var/lib/infermesh"), 0o700); err != nil {
			t.Fatal(err)
		}
		key, err := identity.WriteNewKey(filepath.Join(dir, "var/lib/infermesh", identity.NodeKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		h.pub = identity.EncodeNodeKey(key.Public().(ed25519.PublicKey))
	}
	for _, h := range c.hosts {
		dir := filepath.Join(tmp, h.name)
		files := map[string][]byte{
			"etc/infermesh/infermesh.yaml":          []byte(c.config(h)),
			"etc/systemd/system/infermeshd.service": unit,
			"etc/sysusers.d/infermesh.conf":         configs.Sysusers,
		}
		if files["etc/infermesh/keyring.json"], err = os.ReadFile(keyring); err != nil {
			t.Fatal(err)
		}
		for _, b := range []string{"infermeshd", "infermesh", "infermesh-demo", "e2eload"} {
			if files["usr/local/bin/"+b], err = os.ReadFile(bins[b]); err != nil {
				t.Fatal(err)
			}
		}
		for name, data := range files {
			p := filepath.Join(dir, name)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			mode := os.FileMode(0o644)
			switch {
			case strings.HasPrefix(name, "usr/local/bin/"):
				mode = 0o755
			case strings.HasSuffix(name, "keyring.json"):
				mode = 0o600
			}
			if err := os.WriteFile(p, data, mode); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(filepath.Join(dir, "var/lib/infermesh"), 0o700); err != nil {
			t.Fatal(err)
		}
		// docker cp gives the host's /var and /var/lib these modes: the
		// agent's user must pass through them.
		for _, d := range []string{"var", "var/lib"} {
			if err := os.Chmod(filepath.Join(dir, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		for _, sub := range []string{"etc", "usr", "var"} {
			if _, err := docker(ctx, "cp", filepath.Join(dir, sub), h.ctr+":/"); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, h := range c.hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, code := c.exec(h, "sh", "-c", "systemd-sysusers && chgrp -R infermesh /etc/infermesh && chown infermesh /etc/infermesh/keyring.json && systemctl daemon-reload && systemctl enable --now infermeshd"); code != 0 {
				t.Errorf("%s: start infermeshd: %s\n%s", h.name, out, c.journal(h))
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if _, err := c.waitWhole(c.hosts, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *cluster) servers() []*host {
	return slices.DeleteFunc(slices.Clone(c.hosts), func(h *host) bool { return !h.serve })
}

func names(hs []*host) []string {
	var out []string
	for _, h := range hs {
		out = append(out, h.name)
	}
	return out
}

// config is h's /etc/infermesh/infermesh.yaml.
func (c *cluster) config(h *host) string {
	var b strings.Builder
	fmt.Fprintf(&b, "node: {name: %s, state_dir: /var/lib/infermesh}\n", h.name)
	fmt.Fprintf(&b, "mesh:\n  bind: %s:7946\n  quic: %s:7947\n  gossip_keyring: /etc/infermesh/keyring.json\n  join: [", h.ip, h.ip)
	var join []string
	for _, o := range c.hosts {
		if o != h {
			join = append(join, o.ip+":7946")
		}
	}
	b.WriteString(strings.Join(join, ", ") + "]\n")
	b.WriteString("trust:\n  nodes:\n")
	for _, o := range c.hosts {
		fmt.Fprintf(&b, "    - {name: %s, public_key: %q}\n", o.name, o.pub)
	}
	b.WriteString("proxy: {shutdown_timeout: 30s}\n")
	b.WriteString("roles:\n  chat:\n    port: 18080\n")
	if !h.serve {
		fmt.Fprintf(&b, "    accept_from: [%s]\n", strings.Join(names(c.servers()), ", "))
		return b.String()
	}
	fmt.Fprintf(&b, "    model: demo\n    expose: true\n    serve_to: [%s]\n", c.hosts[0].name)
	b.WriteString("    instance:\n      runtime: native\n      command: /usr/local/bin/infermesh-demo\n")
	b.WriteString(`      args: ["-listen", "127.0.0.1:8091", "-model", "demo", "-tokens", "64", "-token-delay", "20ms"]` + "\n")
	b.WriteString("      port: 8091\n      health: /health\n")
	return b.String()
}

// exec runs argv in h (docker exec) and returns its combined output and
// exit code (-1 when it could not run).
func (c *cluster) exec(h *host, argv ...string) (string, int) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, errb, code, err := nodeimage.Exec(ctx, c.api, h.ctr, argv...)
	if err != nil {
		return err.Error(), -1
	}
	return strings.TrimSpace(out + errb), code
}

func (c *cluster) journal(h *host) string {
	out, _ := c.exec(h, "journalctl", "-u", "infermeshd", "--no-pager", "-n", "40")
	return out
}

type status struct {
	Mesh struct {
		Admitted int `json:"admitted"`
	} `json:"mesh"`
	RemoteRoles []struct {
		Role  string   `json:"role"`
		Nodes []string `json:"nodes"`
	} `json:"remote_roles"`
}

// whole reports whether the mesh of live is whole: every host admits all
// of them, and h0 resolves chat to every live server.
func (c *cluster) whole(live []*host) (bool, string) {
	for _, h := range live {
		out, code := c.exec(h, "infermesh", "status", "--json")
		var st status
		if code != 0 || json.Unmarshal([]byte(out), &st) != nil {
			return false, h.name + ": status: " + out
		}
		if st.Mesh.Admitted != len(live) {
			return false, fmt.Sprintf("%s admits %d of %d", h.name, st.Mesh.Admitted, len(live))
		}
		if h == c.hosts[0] {
			var want, got []string
			for _, s := range live {
				if s.serve {
					want = append(want, s.name)
				}
			}
			for _, r := range st.RemoteRoles {
				if r.Role == "chat" {
					got = slices.Sorted(slices.Values(r.Nodes))
				}
			}
			if !slices.Equal(got, want) {
				return false, fmt.Sprintf("h0 resolves chat to %v, want %v", got, want)
			}
		}
	}
	return true, ""
}

// waitWhole waits until the mesh of live is whole and returns when.
func (c *cluster) waitWhole(live []*host, bound time.Duration) (time.Time, error) {
	deadline := time.Now().Add(bound)
	for {
		ok, why := c.whole(live)
		if ok {
			return time.Now(), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("mesh not whole after %v: %s", bound, why)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
