package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// certNode is a node a with a mesh on loopback, its node key and keyring
// in its state dir, admitted by authority when its certificate says so.
type certNode struct {
	dir, state, sock string
	key, authority   ed25519.PrivateKey
}

func newCertNode(t *testing.T) *certNode {
	t.Helper()
	n := &certNode{dir: t.TempDir()}
	n.state = filepath.Join(n.dir, "state")
	n.sock = filepath.Join(n.dir, "admin.sock")
	if err := os.MkdirAll(n.state, 0o700); err != nil {
		t.Fatal(err)
	}
	var err error
	if n.key, err = identity.WriteNewKey(filepath.Join(n.state, identity.NodeKeyFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := identity.WriteNewKeyring(filepath.Join(n.state, "keyring.json")); err != nil {
		t.Fatal(err)
	}
	_, n.authority, _ = ed25519.GenerateKey(rand.Reader)
	return n
}

// config writes a's config with the certificate cert issued by by to name,
// and returns its path.
func (n *certNode) config(t *testing.T, by ed25519.PrivateKey, name string) string {
	t.Helper()
	c, err := identity.IssueCertificate(by, name, n.key.Public().(ed25519.PublicKey), identity.ScopeFull, 30*24*time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	ip := "127.0.0.1"
	path := filepath.Join(n.dir, name+".yaml")
	y := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nmesh: {bind: '%s:%d', quic: '%s:%d'}\ntrust: {authority: %q, certificate: %q}\nroles:\n  chat: {port: %d, upstream: 'http://127.0.0.1:9'}\n",
		n.state, n.sock, ip, testnet.TCPUDPPort(t, ip), ip, testnet.UDPPort(t, ip),
		identity.EncodeAuthorityKey(n.authority.Public().(ed25519.PublicKey)), c.String(), testnet.TCPPort(t, ip))
	if err := os.WriteFile(path, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// exitsWith runs infermeshd with args and wants it to exit with code, its
// output mentioning want; an agent that starts instead is stopped.
func exitsWith(t *testing.T, code int, want string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	var ee *exec.ExitError
	if ctx.Err() != nil {
		t.Fatalf("infermeshd %v ran on (it started); want exit %d mentioning %q:\n%s", args, code, want, out)
	}
	if !errors.As(err, &ee) || ee.ExitCode() != code {
		t.Errorf("infermeshd %v: %v, want exit %d\n%s", args, err, code, out)
	}
	if !strings.Contains(string(out), want) {
		t.Errorf("infermeshd %v: output %q, want it to mention %q", args, out, want)
	}
}

// TestValidateChecksTheCertificate: --validate exits 0 exactly when the
// agent starts. A certificate signed by another authority than
// trust.authority, or issued to another name than node.name, fails both,
// naming the field and the cause (78, a config error); a good one passes
// both.
func TestValidateChecksTheCertificate(t *testing.T) {
	n := newCertNode(t)
	_, other, _ := ed25519.GenerateKey(rand.Reader)
	for _, tt := range []struct {
		name, cfg, want string
	}{
		{"another authority", n.config(t, other, "a"), "trust.certificate: not signed by trust.authority"},
		{"another name", n.config(t, n.authority, "b"), `trust.certificate: issued to node "b", but node.name is "a"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			exitsWith(t, exitConfig, tt.want, "--validate", "--config", tt.cfg)
			exitsWith(t, exitConfig, tt.want, "--config", tt.cfg)
			if _, err := os.Stat(n.sock); err == nil {
				t.Error("the refused start opened its admin socket")
			}
		})
	}
	good := n.config(t, n.authority, "a")
	out, err := exec.Command(bin, "--validate", "--config", good).CombinedOutput()
	if err != nil || string(out) != good+": valid (node a, site default, 1 roles)\n" {
		t.Errorf("--validate of a good certificate: %v, %q; want exit 0, valid, no warning", err, out)
	}
	startAgent(t, "--config", good)
}

// TestValidateWarnsOfUnservableRoles: a role nothing can serve is valid
// (the agent starts with it), and said so: on stderr by --validate, which
// exits 0, and in the agent's log at start.
func TestValidateWarnsOfUnservableRoles(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "infermesh.yaml")
	y := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nroles:\n  chat: {port: %d}\n",
		dir, filepath.Join(dir, "admin.sock"), testnet.TCPPort(t, "127.0.0.1"))
	if err := os.WriteFile(cfg, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	const warning = "roles.chat: nothing can serve it: it has no upstream and no instance, and no mesh is configured (mesh.bind), so no peer can; add roles.chat.upstream (http://127.0.0.1:<port> of a running server) or roles.chat.instance"
	cmd := exec.Command(bin, "--validate", "--config", cfg)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("--validate: %v, want exit 0 (the agent starts with it)\n%s", err, stderr.String())
	}
	if want := cfg + ": valid (node a, site default, 1 roles); 1 warning on stderr\n"; string(out) != want {
		t.Errorf("--validate stdout = %q, want %q", out, want)
	}
	if want := "infermeshd: warning: " + warning + "\n"; stderr.String() != want {
		t.Errorf("--validate stderr = %q, want %q", stderr.String(), want)
	}
	a := startAgent(t, "--config", cfg)
	if s := logsString(a); !strings.Contains(s, `"msg":"`+warning+`"`) {
		t.Errorf("the agent's log does not warn %q:\n%s", warning, s)
	}
}
