package nodeimage

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"golang.org/x/crypto/ssh"

	"github.com/infermesh/infermesh/configs"
	"github.com/infermesh/infermesh/internal/testing/leakcheck"
	"github.com/infermesh/infermesh/internal/testing/testbin"
	"github.com/infermesh/infermesh/provision"
)

var (
	testTag  string
	bins     map[string]string
	runLabel = fmt.Sprintf("nodeimage-%x", time.Now().UnixNano()&0xffffffff)
)

func TestMain(m *testing.M) {
	code, err := setup(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodeimage tests:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func setup(m *testing.M) (int, error) {
	cli, err := provision.NewDockerClient()
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	testTag, err = Ensure(ctx, cli, Options{Log: func(l string) { fmt.Fprintln(os.Stderr, "node image:", l) }})
	cli.Close()
	if err != nil {
		return 0, err
	}
	dir, err := os.MkdirTemp("", "nodeimage-bins-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	if bins, err = testbin.Build(dir, "./cmd/infermeshd"); err != nil {
		return 0, err
	}
	code := m.Run()
	code = leakcheck.Check(code)
	return code, nil
}

func testClient(t *testing.T) *provision.DockerClient {
	t.Helper()
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func newKey(t *testing.T) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// bootNode boots a node container removed when the test ends, and waits
// until it is ready.
func bootNode(t *testing.T, cli *provision.DockerClient, hostKey ed25519.PrivateKey, authorized ...ssh.PublicKey) (string, Ready) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := fmt.Sprintf("%s-%s", runLabel, strings.ToLower(strings.ReplaceAll(t.Name(), "/", "-")))
	id, err := Boot(ctx, cli, BootOptions{
		Tag: testTag, Name: name, Labels: map[string]string{"io.infermesh.test": runLabel},
		HostKey: hostKey, AuthorizedKeys: authorized,
	})
	if id != "" {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := cli.ContainerRemove(ctx, id, container.RemoveOptions{Force: true}); err != nil && !cerrdefs.IsNotFound(err) {
				t.Errorf("remove %s: %v", name, err)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	ready, err := WaitReady(ctx, cli, id)
	if err != nil {
		t.Fatal(err)
	}
	return id, ready
}

func TestTagCoversEveryRecipeInput(t *testing.T) {
	base := Tag()
	if got := Tag(); got != base {
		t.Fatalf("Tag() = %q then %q: not deterministic", base, got)
	}
	if !strings.HasPrefix(base, Repository+":") || len(base) != len(Repository)+1+16 {
		t.Errorf("Tag() = %q, want %s:<16 hex>", base, Repository)
	}
	if got := TagFor("http://mirror.example/debian"); got == base {
		t.Error("a different mirror gives the same tag")
	}
	for name, mutate := range map[string]func(){
		"packages": func() { Packages = append(Packages, "curl") },
		"edits":    func() { edits[1].Data += "#\n" },
		"changes":  func() { changes = append(changes, "ENV A=b") },
	} {
		savedP, savedE, savedC := append([]string(nil), Packages...), append([]edit(nil), edits...), append([]string(nil), changes...)
		mutate()
		if got := Tag(); got == base {
			t.Errorf("changing the %s leaves the tag %q", name, got)
		}
		Packages, edits, changes = savedP, savedE, savedC
	}
	if got := Tag(); got != base {
		t.Fatalf("restoring the recipe gives %q, want %q", got, base)
	}
}

// TestLockSerializesBuilders: a second builder of a tag waits for the
// first to release the lock, and gives up when its context ends.
func TestLockSerializesBuilders(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	unlock, err := lock(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := lock(ctx, path); err == nil {
		t.Fatal("a second lock was granted while the first is held")
	}
	var got sync.WaitGroup
	got.Add(1)
	acquired := make(chan struct{})
	go func() {
		defer got.Done()
		u, err := lock(context.Background(), path)
		if err != nil {
			t.Error(err)
			return
		}
		close(acquired)
		u()
	}()
	select {
	case <-acquired:
		t.Fatal("the waiting builder got the lock before the first released it")
	case <-time.After(200 * time.Millisecond):
	}
	unlock()
	got.Wait()
}

// TestEnsureReusesTheImage: with the image present, Ensure returns its tag
// without building, from several goroutines at once.
func TestEnsureReusesTheImage(t *testing.T) {
	cli := testClient(t)
	before, err := cli.ImageInspect(context.Background(), testTag)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tag, err := Ensure(context.Background(), cli, Options{Log: func(l string) { t.Errorf("Ensure built: %s", l) }})
			if err != nil || tag != testTag {
				t.Errorf("Ensure = %q, %v; want %q", tag, err, testTag)
			}
		}()
	}
	wg.Wait()
	after, err := cli.ImageInspect(context.Background(), testTag)
	if err != nil {
		t.Fatal(err)
	}
	if before.ID != after.ID {
		t.Errorf("image id changed from %s to %s: rebuilt", before.ID, after.ID)
	}
	if got := after.Config.Labels[LabelRecipe]; got != RecipeHash(DefaultMirror) {
		t.Errorf("image label %s = %q, want the recipe hash", LabelRecipe, got)
	}
}

// TestNodeContainer boots one node container and checks what the package
// promises of it: systemd as PID 1 running, sshd active and presenting
// only the seeded host key, root logging in with the seeded key, and
// configs/infermeshd.service starting unchanged as Type=notify.
func TestNodeContainer(t *testing.T) {
	cli := testClient(t)
	hostKey, clientKey := newKey(t), newKey(t)
	signer, err := ssh.NewSignerFromKey(clientKey)
	if err != nil {
		t.Fatal(err)
	}
	id, ready := bootNode(t, cli, hostKey, signer.PublicKey())
	if ready.State != "running" {
		t.Errorf("system state %s (failed units %v), want running", ready.State, ready.Failed)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	t.Run("systemd is PID 1", func(t *testing.T) {
		out, _, _, err := Exec(ctx, cli, id, "cat", "/proc/1/comm")
		if err != nil || strings.TrimSpace(out) != "systemd" {
			t.Errorf("/proc/1/comm = %q, %v; want systemd", out, err)
		}
	})

	t.Run("ssh with the pinned host key", func(t *testing.T) {
		info, err := cli.ContainerInspect(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		addr := net.JoinHostPort(info.NetworkSettings.IPAddress, "22")
		hostPub, _ := ssh.NewPublicKey(hostKey.Public())
		conf := &ssh.ClientConfig{
			User:              "root",
			Auth:              []ssh.AuthMethod{ssh.PublicKeys(signer)},
			HostKeyCallback:   ssh.FixedHostKey(hostPub),
			HostKeyAlgorithms: []string{ssh.KeyAlgoED25519},
			Timeout:           10 * time.Second,
		}
		c, err := ssh.Dial("tcp", addr, conf)
		if err != nil {
			t.Fatalf("ssh %s with the seeded host key: %v", addr, err)
		}
		defer c.Close()
		s, err := c.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		out, err := s.Output("systemctl is-active ssh.service; ls /etc/ssh/ | grep -c '^ssh_host_.*_key$'")
		s.Close()
		if got := strings.Fields(string(out)); err != nil || len(got) != 2 || got[0] != "active" || got[1] != "1" {
			t.Errorf("over ssh: %q, %v; want ssh active and exactly one host key", out, err)
		}
		// Another key is refused before authentication.
		other, _ := ssh.NewPublicKey(newKey(t).Public())
		conf.HostKeyCallback = ssh.FixedHostKey(other)
		if c2, err := ssh.Dial("tcp", addr, conf); err == nil {
			c2.Close()
			t.Error("ssh accepted a host key other than the seeded one")
		}
	})

	t.Run("infermeshd.service unchanged", func(t *testing.T) {
		unit, err := os.ReadFile("../../configs/infermeshd.service")
		if err != nil {
			t.Fatal(err)
		}
		agentBin, err := os.ReadFile(bins["infermeshd"])
		if err != nil {
			t.Fatal(err)
		}
		cfg := "node: {name: n1, state_dir: /var/lib/infermesh}\nroles:\n  chat: {port: 18080, upstream: \"http://127.0.0.1:8081\", model: demo}\n"
		archive := tarOf(t, map[string]tarFile{
			"usr/local/bin/infermeshd":              {0o755, agentBin},
			"etc/infermesh/infermesh.yaml":          {0o640, []byte(cfg)},
			"etc/systemd/system/infermeshd.service": {0o644, unit},
			"etc/sysusers.d/infermesh.conf":         {0o644, configs.Sysusers},
		})
		if err := cli.CopyToContainer(ctx, id, "/", bytes.NewReader(archive), container.CopyToContainerOptions{}); err != nil {
			t.Fatal(err)
		}
		if out, errOut, code, err := Exec(ctx, cli, id, "sh", "-c", "systemd-sysusers && chgrp infermesh /etc/infermesh/infermesh.yaml && systemctl daemon-reload && systemctl start infermeshd"); err != nil || code != 0 {
			t.Fatalf("systemctl start infermeshd: exit %d %v\n%s%s", code, err, out, errOut)
		}
		out, _, _, err := Exec(ctx, cli, id, "systemctl", "show", "-p", "Type", "-p", "ActiveState", "-p", "StatusText", "infermeshd")
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"Type=notify", "ActiveState=active", "StatusText=serving 1 role(s)"} {
			if !strings.Contains(out, want) {
				t.Errorf("systemctl show infermeshd:\n%s\nwant %s", out, want)
			}
		}
	})
}

type tarFile struct {
	mode int64
	data []byte
}

func tarOf(t *testing.T, files map[string]tarFile) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: f.mode, Size: int64(len(f.data)), ModTime: time.Now()}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(f.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
