package node

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"github.com/infermesh/infermesh/internal/testing/testimage"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"golang.org/x/crypto/ssh"

	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/internal/testing/nodetest"
	"github.com/infermesh/infermesh/provision"
)

// These tests run node containers on the real Docker engine: systemd as
// PID 1 and a real OpenSSH sshd (internal/nodeimage).

var (
	imageTag string
	runTag   = fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff)
	siteN    atomic.Int32
)

func engine(t *testing.T) *provision.DockerClient {
	t.Helper()
	cli, tag := nodetest.Setup(t)
	imageTag = tag
	return cli
}

// testSite is a site name unique to this run and test; every container
// labelled with it is removed when the test ends.
func testSite(t *testing.T, cli *provision.DockerClient) string {
	t.Helper()
	site := fmt.Sprintf("nt%s-%d", runTag, siteN.Add(1))
	nodetest.RemoveSiteAtCleanup(t, cli, site)
	return site
}

func newSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func quickSSH(signer ssh.Signer) SSHConfig {
	return SSHConfig{Signer: signer, ConnectTimeout: 60 * time.Second, KeepAliveInterval: time.Second, KeepAliveTimeout: 5 * time.Second}
}

func dockerSpec(name string) Spec {
	s := testSpec(KindDocker)
	s.Name = name
	s.Docker = &DockerTarget{Image: imageTag}
	return s
}

// runOut runs line and returns its stdout.
func runOut(t *testing.T, c Client, line string) string {
	t.Helper()
	var out []string
	code, err := c.Run(context.Background(), RemoteCommand{Line: line, Stdout: func(l string) { out = append(out, l) }})
	if err != nil || code != 0 {
		t.Fatalf("%s: exit %d, %v", line, code, err)
	}
	return strings.Join(out, "\n")
}

// TestDockerLease: a node container gets a deterministic name, our labels
// and the join environment; its host key is pinned from the first byte
// (another key is refused before authentication); a stopped container has
// no endpoint; Destroy is ownership-checked and idempotent; another
// provider's spec or handle is refused.
func TestDockerLease(t *testing.T) {
	cli := engine(t)
	site := testSite(t, cli)
	signer := newSigner(t)
	lease, err := NewDockerLease(cli, DockerLeaseConfig{Site: site, Owner: "a", AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}, StopTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	spec := dockerSpec("lab-3")
	facts, ep, err := lease.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if ep == nil || ep.Port != 22 || ep.User != "root" || len(ep.HostKeys) != 1 {
		t.Fatalf("endpoint = %+v, want root@<ip>:22 with the host key pinned", ep)
	}
	info, err := cli.ContainerInspect(ctx, facts.ContractID)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.TrimPrefix(info.Name, "/"), "infermesh-"+site+"-a-node-lab-3"; got != want {
		t.Errorf("container name = %s, want %s", got, want)
	}
	for k, v := range map[string]string{
		provision.LabelManagedBy: "infermesh", provision.LabelSite: site, provision.LabelNode: "lab-3",
		provision.LabelRun: "42", provision.LabelTarget: "lab-3", LabelOwner: "a", LabelKind: "node",
	} {
		if got := info.Config.Labels[k]; got != v {
			t.Errorf("label %s = %q, want %q", k, got, v)
		}
	}
	env := strings.Join(info.Config.Env, " ")
	for _, want := range []string{"INFERMESH_RUN=42", "INFERMESH_NODE=lab-3", "INFERMESH_JOIN=10.9.0.1:7946", "INFERMESH_JOIN_CREDENTIAL_REF=file:/var/lib/infermesh/node.cert"} {
		if !strings.Contains(env, want) {
			t.Errorf("env %s lacks %s", env, want)
		}
	}

	// The pinned key is the container's only host key.
	c := NewSSHClient(quickSSH(signer))
	if err := c.Connect(ctx, *ep, nil); err != nil {
		t.Fatalf("Connect with the pinned key: %v", err)
	}
	served, err := ParseAuthorizedKey(runOut(t, c, "cat /etc/ssh/ssh_host_ed25519_key.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if AuthorizedKey(served) != facts.HostKeys[0] {
		t.Errorf("host key on the node %s, pinned %s", AuthorizedKey(served), facts.HostKeys[0])
	}
	accepted := runOut(t, c, "journalctl -u ssh --no-pager -o cat | grep -c 'Accepted publickey' || true")
	c.Close()

	// Another key: refused during key exchange, so sshd never sees an
	// authentication attempt.
	other := newSigner(t).PublicKey()
	wrong := *ep
	wrong.HostKeys = []string{AuthorizedKey(other)}
	c2 := NewSSHClient(quickSSH(signer))
	err = c2.Connect(ctx, wrong, nil)
	c2.Close()
	if !errors.Is(err, ErrHostKeyMismatch) {
		t.Fatalf("Connect with a wrong pin = %v, want ErrHostKeyMismatch", err)
	}
	// Its own stage, both fingerprints named, and nothing else in the way
	// ("ssh: handshake failed:").
	served0, _ := ParseAuthorizedKey(facts.HostKeys[0])
	var ce *ConnectError
	if want := fmt.Sprintf("host key mismatch: %s presented ssh-ed25519 %s, pinned: %s", ep.Addr(), ssh.FingerprintSHA256(served0), ssh.FingerprintSHA256(other)); !errors.As(err, &ce) || ce.Stage != StageHostKeyMismatch || err.Error() != want {
		t.Errorf("Connect with a wrong pin = %q\nwant a ConnectError at %s: %q", err, StageHostKeyMismatch, want)
	}
	c3 := NewSSHClient(quickSSH(signer))
	if err := c3.Connect(ctx, *ep, nil); err != nil {
		t.Fatal(err)
	}
	journal := runOut(t, c3, "journalctl -u ssh --no-pager -o cat")
	c3.Close()
	if n := strings.Count(journal, "Accepted publickey"); fmt.Sprint(n-1) != strings.TrimSpace(accepted) {
		t.Errorf("sshd accepted %d keys, want %s before the wrong-pin attempt plus this one:\n%s", n, accepted, journal)
	}
	if strings.Contains(journal, "authenticating user") || strings.Contains(journal, "Failed publickey") {
		t.Errorf("sshd saw an authentication attempt from the wrong-pin connection:\n%s", journal)
	}

	// Another provider's spec and handle are refused.
	if _, _, err := lease.Create(ctx, testSpec(KindSSH)); err == nil {
		t.Error("the docker lease created an ssh spec")
	}
	if err := lease.Destroy(ctx, DestroyHandle{Provider: KindSSH, Node: "lab-3"}); err == nil {
		t.Error("the docker lease destroyed an ssh handle")
	}

	// Stopped: no endpoint.
	stop := 0
	if err := cli.ContainerStop(ctx, facts.ContractID, container.StopOptions{Timeout: &stop}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := lease.LookupEndpoint(ctx, facts); err != nil || ok {
		t.Errorf("LookupEndpoint of a stopped container = %v, %v; want none", ok, err)
	}

	// Destroy by id, then by name (nothing left): both succeed.
	if err := lease.Destroy(ctx, facts.DestroyHandle("lab-3")); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.ContainerInspect(ctx, facts.ContractID); !cerrdefs.IsNotFound(err) {
		t.Errorf("container still there after Destroy: %v", err)
	}
	if err := lease.Destroy(ctx, DestroyHandle{Provider: KindDocker, Node: "lab-3"}); err != nil {
		t.Errorf("second Destroy = %v, want nil", err)
	}

	// A container at a node's name that is not ours is never removed.
	squat := lease.ContainerName("squat")
	cc, hc := nodeimage.ContainerConfig(imageTag)
	cc.Labels = map[string]string{provision.LabelSite: site}
	if _, err := cli.ContainerCreate(ctx, cc, hc, nil, nil, squat); err != nil {
		t.Fatal(err)
	}
	if err := lease.Destroy(ctx, DestroyHandle{Provider: KindDocker, Node: "squat"}); !errors.Is(err, ErrNotOwned) {
		t.Errorf("Destroy of a foreign container = %v, want ErrNotOwned", err)
	}
	if _, err := cli.ContainerInspect(ctx, squat); err != nil {
		t.Errorf("the foreign container is gone: %v", err)
	}
}

// TestSSHClientDeadlines: a command past its deadline, a cancelled
// command, and a host that stops answering (the container frozen) each
// end the command and close the connection, well before the command would
// have ended.
func TestSSHClientDeadlines(t *testing.T) {
	cli := engine(t)
	site := testSite(t, cli)
	signer := newSigner(t)
	lease, err := NewDockerLease(cli, DockerLeaseConfig{Site: site, Owner: "a", AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}, StopTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	facts, ep, err := lease.Create(context.Background(), dockerSpec("slow"))
	if err != nil {
		t.Fatal(err)
	}
	connect := func(cfg SSHConfig) *SSHClient {
		t.Helper()
		c := NewSSHClient(cfg)
		t.Cleanup(func() { c.Close() })
		if err := c.Connect(context.Background(), *ep, nil); err != nil {
			t.Fatal(err)
		}
		return c
	}
	// Each case's command would run ten minutes; the test gives it one.
	within := func(t *testing.T, f func() error) error {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute):
			t.Fatal("the command did not end")
			return nil
		}
	}
	afterwards := func(t *testing.T, c *SSHClient) {
		t.Helper()
		if _, err := c.Run(context.Background(), RemoteCommand{Line: "true"}); err == nil || !strings.Contains(err.Error(), "connection closed") {
			t.Errorf("Run after = %v, want the connection closed", err)
		}
	}

	t.Run("command deadline", func(t *testing.T) {
		c := connect(quickSSH(signer))
		err := within(t, func() error {
			_, err := c.Run(context.Background(), RemoteCommand{Line: "sleep 600", Timeout: 500 * time.Millisecond})
			return err
		})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Run = %v, want the deadline", err)
		}
		afterwards(t, c)
	})
	t.Run("cancel", func(t *testing.T) {
		c := connect(quickSSH(signer))
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(300*time.Millisecond, cancel)
		err := within(t, func() error {
			_, err := c.Run(ctx, RemoteCommand{Line: "sleep 600"})
			return err
		})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want cancelled", err)
		}
		afterwards(t, c)
	})
	t.Run("keep-alive watchdog", func(t *testing.T) {
		cfg := quickSSH(signer)
		cfg.KeepAliveInterval, cfg.KeepAliveTimeout = 200*time.Millisecond, 2*time.Second
		c := connect(cfg)
		eng := testimage.Engine(t)
		started := make(chan struct{})
		var once sync.Once
		go func() {
			// Freeze the host once the command runs: sshd stops answering.
			<-started
			// The engine's freezer can fail on a loaded machine ("unable
			// to freeze": a process kept running while it froze the
			// cgroup); the fault is what is retried, not the check.
			var err error
			for attempt := range 10 {
				if err = eng.ContainerPause(context.Background(), facts.ContractID); err == nil || !strings.Contains(err.Error(), "unable to freeze") {
					break
				}
				time.Sleep(time.Duration(attempt+1) * 50 * time.Millisecond)
			}
			if err != nil {
				t.Errorf("pause: %v", err)
			}
		}()
		t.Cleanup(func() { _ = eng.ContainerUnpause(context.Background(), facts.ContractID) })
		err := within(t, func() error {
			_, err := c.Run(context.Background(), RemoteCommand{Line: "echo go; sleep 600", Stdout: func(string) { once.Do(func() { close(started) }) }})
			return err
		})
		if err == nil || !strings.Contains(err.Error(), "keep-alive") {
			t.Errorf("Run = %v, want the keep-alive watchdog's close", err)
		}
		afterwards(t, c)
	})
}
