package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/internal/testbin"
	"github.com/infermesh/infermesh/provision"
)

// TestUnitKeepsNativeInstancesAcrossRestarts runs the shipped unit
// (configs/infermeshd.service) under systemd in a node container, with a
// native instance, and shows what its KillMode=process is for: systemctl
// restart and a crash of the agent (SIGKILL, restarted by Restart=) leave
// the instance running and the next agent adopts it (the same pid);
// systemctl stop stops the agent only, and `infermesh site cleanup` then
// stops the instance. With the default KillMode=control-group a restart
// kills it.
func TestUnitKeepsNativeInstancesAcrossRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a systemd node container on the Docker engine; skipped in -short mode only")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	tag, err := nodeimage.Ensure(ctx, cli, nodeimage.Options{Log: func(l string) { t.Log("node image:", l) }})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bins, err := testbin.Build(dir, "./cmd/infermeshd", "./cmd/infermesh", "./cmd/infermesh-demo")
	if err != nil {
		t.Fatal(err)
	}
	_, hostKey, _ := ed25519.GenerateKey(rand.Reader)
	name := fmt.Sprintf("infermeshd-unit-%x", time.Now().UnixNano()&0xffffffff)
	id, err := nodeimage.Boot(ctx, cli, nodeimage.BootOptions{Tag: tag, Name: name, Labels: map[string]string{"io.infermesh.test": name}, HostKey: hostKey})
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
	if _, err := nodeimage.WaitReady(ctx, cli, id); err != nil {
		t.Fatal(err)
	}
	sh := func(cmd string) string {
		t.Helper()
		out, errOut, code, err := nodeimage.Exec(ctx, cli, id, "sh", "-c", cmd)
		if err != nil || code != 0 {
			t.Fatalf("%s: exit %d %v\n%s%s", cmd, code, err, out, errOut)
		}
		return out
	}

	unit, err := os.ReadFile("../../configs/infermeshd.service")
	if err != nil {
		t.Fatal(err)
	}
	cfg := `node: {name: n1}
site: unit
roles:
  chat:
    port: 18080
    model: m
    instance: {runtime: native, command: /usr/local/bin/infermesh-demo, args: [-listen, "127.0.0.1:8091", -model, m], port: 8091, restart: {backoff: 100ms}}
`
	files := map[string][]byte{"etc/infermesh/infermesh.yaml": []byte(cfg), "etc/systemd/system/infermeshd.service": unit}
	for name, path := range bins {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		files["usr/local/bin/"+name] = b
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, data := range files {
		mode := int64(0o644)
		if strings.HasPrefix(name, "usr/local/bin/") {
			mode = 0o755
		}
		tw.WriteHeader(&tar.Header{Name: name, Mode: mode, Size: int64(len(data)), ModTime: time.Now()})
		tw.Write(data)
	}
	tw.Close()
	if err := cli.CopyToContainer(ctx, id, "/", &buf, container.CopyToContainerOptions{}); err != nil {
		t.Fatal(err)
	}
	sh("systemctl daemon-reload && systemctl start infermeshd")

	// readyPID waits for the instance to be ready and returns its pid.
	readyPID := func(what string) int {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		var last string
		for time.Now().Before(deadline) {
			out, _, code, err := nodeimage.Exec(ctx, cli, id, "infermesh", "instances", "--json", "--wait", "5s")
			last = out
			if err == nil && code == 0 {
				var is []admin.Instance
				if json.Unmarshal([]byte(out), &is) == nil && len(is) == 1 && is[0].State == "ready" && is[0].PID > 0 {
					return is[0].PID
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatalf("%s: the instance is not ready: %s", what, last)
		return 0
	}
	alive := func(pid int) bool {
		_, _, code, err := nodeimage.Exec(ctx, cli, id, "sh", "-c", fmt.Sprintf("test -e /proc/%[1]d/status && ! grep -q '^State:[[:space:]]*Z' /proc/%[1]d/status", pid))
		return err == nil && code == 0
	}
	pid := readyPID("started")

	sh("systemctl restart infermeshd")
	if got := readyPID("after systemctl restart"); got != pid {
		t.Errorf("after systemctl restart the instance is pid %d, want %d adopted", got, pid)
	}

	agent := strings.TrimSpace(sh("systemctl show -p MainPID --value infermeshd"))
	sh("systemctl kill -s KILL --kill-whom=main infermeshd")
	deadline := time.Now().Add(time.Minute)
	for strings.TrimSpace(sh("systemctl show -p MainPID --value infermeshd")) == agent || strings.TrimSpace(sh("systemctl show -p MainPID --value infermeshd")) == "0" {
		if time.Now().After(deadline) {
			t.Fatal("systemd did not restart the killed agent")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if got := readyPID("after the agent was killed"); got != pid {
		t.Errorf("after the agent was killed the instance is pid %d, want %d adopted", got, pid)
	}

	sh("systemctl stop infermeshd")
	if !alive(pid) {
		t.Fatal("systemctl stop killed the instance: KillMode=process stops the agent only")
	}
	out := sh("infermesh site cleanup --targets n1")
	if !strings.Contains(out, fmt.Sprintf("process %d", pid)) || alive(pid) {
		t.Errorf("site cleanup after the stop: instance alive %v\n%s", alive(pid), out)
	}

	// The default KillMode kills the instance with every restart.
	sh("mkdir -p /etc/systemd/system/infermeshd.service.d && printf '[Service]\\nKillMode=control-group\\n' > /etc/systemd/system/infermeshd.service.d/killmode.conf && systemctl daemon-reload && systemctl start infermeshd")
	pid = readyPID("with KillMode=control-group")
	sh("systemctl restart infermeshd")
	if got := readyPID("restarted with KillMode=control-group"); got == pid || alive(pid) {
		t.Errorf("with KillMode=control-group the instance survived a restart (pid %d, now %d)", pid, got)
	}
}
