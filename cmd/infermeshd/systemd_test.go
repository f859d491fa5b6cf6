package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/configs"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/internal/testing/nodetest"
	"github.com/infermesh/infermesh/internal/testing/testbin"
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
//
// It starts as an upgrade: first the unit as it was (User=root), then the
// unit as shipped, running as user infermesh: the root agent's instance is
// refused with the way out named, `infermesh site cleanup` stops it, and
// systemd has handed every directory root wrote to the user.
func TestUnitKeepsNativeInstancesAcrossRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a systemd node container on the Docker engine; skipped in -short mode only")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cfg := `node: {name: n1}
site: unit
roles:
  chat:
    port: 18080
    model: m
    instance: {runtime: native, command: /usr/local/bin/infermesh-demo, args: [-listen, "127.0.0.1:8091", -model, m], port: 8091, restart: {backoff: 100ms}}
`
	// The unit as it was before it ran as its own user: root.
	n := startUnitNode(ctx, t, cfg, map[string][]byte{"etc/systemd/system/infermeshd.service.d/asroot.conf": []byte("[Service]\nUser=root\nGroup=root\n")}, nil)
	cli, id, sh := n.cli, n.id, n.sh

	// instance polls until one instance satisfies ok and returns it.
	instance := func(what string, ok func(admin.Instance) bool) admin.Instance {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		var last string
		for time.Now().Before(deadline) {
			out, _, code, err := nodeimage.Exec(ctx, cli, id, "infermesh", "instances", "--json", "--wait", "5s")
			last = out
			if err == nil && code == 0 {
				var is []admin.Instance
				if json.Unmarshal([]byte(out), &is) == nil && len(is) == 1 && ok(is[0]) {
					return is[0]
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatalf("%s: no instance as wanted: %s", what, last)
		return admin.Instance{}
	}
	// readyPID waits for the instance to be ready and returns its pid.
	readyPID := func(what string) int {
		t.Helper()
		return instance(what, func(i admin.Instance) bool { return i.State == "ready" && i.PID > 0 }).PID
	}
	alive := func(pid int) bool {
		_, _, code, err := nodeimage.Exec(ctx, cli, id, "sh", "-c", fmt.Sprintf("test -e /proc/%[1]d/status && ! grep -q '^State:[[:space:]]*Z' /proc/%[1]d/status", pid))
		return err == nil && code == 0
	}
	user := func(pid int) string { return strings.TrimSpace(sh(fmt.Sprintf("ps -o user= -p %d", pid))) }

	// An upgrade from the unit that ran as root: the agent and its
	// instance ran as root and wrote the state as root.
	pid := readyPID("started as root")
	if u := user(pid); u != "root" {
		t.Fatalf("the instance of the root agent runs as %s", u)
	}
	sh("rm -r /etc/systemd/system/infermeshd.service.d && systemctl daemon-reload && systemctl restart infermeshd")
	// The agent, its own user now, cannot adopt root's process, and says
	// what to do.
	stuck := instance("after the upgrade", func(i admin.Instance) bool { return strings.Contains(i.LastError, "runs as uid 0") })
	if !strings.Contains(stuck.LastError, "site cleanup") {
		t.Errorf("the instance root left: %q, want the way out named", stuck.LastError)
	}
	sh("systemctl stop infermeshd && infermesh site cleanup --targets n1 && systemctl start infermeshd")
	if alive(pid) {
		t.Errorf("site cleanup as root left root's instance %d running", pid)
	}
	pid = readyPID("started as infermesh")
	agentPID, _ := strconv.Atoi(strings.TrimSpace(sh("systemctl show -p MainPID --value infermeshd")))
	if u, au := user(pid), user(agentPID); u != "infermesh" || au != "infermesh" {
		t.Errorf("after the upgrade the agent runs as %s, its instance as %s; want infermesh", au, u)
	}
	// systemd handed the state, cache and runtime directories (written by
	// root before) to the user.
	if out := sh("find /var/lib/infermesh /var/cache/infermesh /run/infermesh ! -user infermesh"); out != "" {
		t.Errorf("after the upgrade these are not infermesh's:\n%s", out)
	}

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
	// As the agent's user: root in a container lacks CAP_SYS_PTRACE, which
	// reading another user's /proc/<pid>/exe takes (root on a host has it).
	out := sh("runuser -u infermesh -- infermesh site cleanup --targets n1")
	if !strings.Contains(out, fmt.Sprintf("process %d", pid)) || alive(pid) {
		t.Errorf("site cleanup after the stop: instance alive %v\n%s", alive(pid), out)
	}

	// The unit's exposure as systemd rates it (9.0 UNSAFE for a unit
	// without hardening; 6.7 while it ran as root).
	score := sh("systemd-analyze security --no-pager infermeshd | tail -1")
	t.Log(strings.TrimSpace(score))
	var exposure float64
	if i := strings.LastIndex(score, ": "); i < 0 {
		t.Errorf("systemd-analyze security: %q", score)
	} else if _, err := fmt.Sscanf(score[i+2:], "%g", &exposure); err != nil || exposure > 3 {
		t.Errorf("systemd-analyze security: %q, want 3.0 or below", score)
	}

	// The default KillMode kills the instance with every restart.
	sh("mkdir -p /etc/systemd/system/infermeshd.service.d && printf '[Service]\\nKillMode=control-group\\n' > /etc/systemd/system/infermeshd.service.d/killmode.conf && systemctl daemon-reload && systemctl start infermeshd")
	pid = readyPID("with KillMode=control-group")
	sh("systemctl restart infermeshd")
	if got := readyPID("restarted with KillMode=control-group"); got == pid || alive(pid) {
		t.Errorf("with KillMode=control-group the instance survived a restart (pid %d, now %d)", pid, got)
	}
}

// unitNode is a node container running configs/infermeshd.service.
type unitNode struct {
	cli *provision.DockerClient
	id  string
	// sh runs a shell command in the container, failing the test on a
	// non-zero exit, and returns its output.
	sh func(cmd string) string
}

// startUnitNode boots a node container (with binds, if any), installs the
// binaries, the unit, its user and cfg as make install does, plus extra
// files, and starts the unit. On failure the unit's journal is logged.
func startUnitNode(ctx context.Context, t *testing.T, cfg string, extra map[string][]byte, binds []string) unitNode {
	t.Helper()
	cli, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	tag, err := nodeimage.Ensure(ctx, cli, nodeimage.Options{Log: func(l string) { t.Log("node image:", l) }})
	if err != nil {
		t.Fatal(err)
	}
	bins, err := testbin.Build(t.TempDir(), "./cmd/infermeshd", "./cmd/infermesh", "./cmd/infermesh-demo")
	if err != nil {
		t.Fatal(err)
	}
	_, hostKey, _ := ed25519.GenerateKey(rand.Reader)
	name := fmt.Sprintf("infermeshd-unit-%x", time.Now().UnixNano()&0xffffffff)
	id, err := nodeimage.Boot(ctx, cli, nodeimage.BootOptions{Tag: tag, Name: name, Labels: map[string]string{"io.infermesh.test": name}, HostKey: hostKey, Binds: binds})
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
	t.Cleanup(func() {
		if t.Failed() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out, _, _, _ := nodeimage.Exec(ctx, cli, id, "sh", "-c", "journalctl -u infermeshd --no-pager -o cat | tail -60; ps -eo user,pid,cmd")
			t.Logf("journal of infermeshd:\n%s", out)
		}
	})
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
	files := map[string][]byte{
		"etc/infermesh/infermesh.yaml":          []byte(cfg),
		"etc/systemd/system/infermeshd.service": unit,
		"etc/sysusers.d/infermesh.conf":         configs.Sysusers,
	}
	maps.Copy(files, extra)
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
	// What make install does besides copying: the user, and the config
	// readable by its group.
	sh("systemd-sysusers && chgrp infermesh /etc/infermesh/infermesh.yaml && chmod 0640 /etc/infermesh/infermesh.yaml")
	sh("systemctl daemon-reload && systemctl start infermeshd")
	return unitNode{cli: cli, id: id, sh: sh}
}

// TestUnitReachesDockerThroughItsGroup: the unit's user reaches the Docker
// engine (the real one, its socket bound into a node container) through
// membership of the docker group in /etc/group, as make install and the
// bootstrap give it, across the unit's sandbox; without it the socket
// refuses the agent.
func TestUnitReachesDockerThroughItsGroup(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a systemd node container on the Docker engine; skipped in -short mode only")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	probe, err := provision.NewDockerClient()
	if err != nil {
		t.Fatal(err)
	}
	host := probe.DaemonHost()
	probe.Close()
	sock, ok := strings.CutPrefix(host, "unix://")
	if !ok {
		t.Fatalf("the Docker engine is at %s, not a unix socket to bind", host)
	}
	// An image no registry has: the agent's pull reaches the engine, which
	// answers that it does not know it; nothing is created.
	site := fmt.Sprintf("unit-docker-%x", time.Now().UnixNano()&0xffffff)
	cfg := "node: {name: n1}\nsite: " + site + "\nroles:\n  chat: {port: 18080, model: m, instance: {image: 'infermesh-unit-missing:none', port: 8080}}\n"
	n := startUnitNode(ctx, t, cfg, nil, []string{sock + ":/run/docker.sock"})
	nodetest.RemoveSiteAtCleanup(t, n.cli, site)
	instance := func(what, want string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		var last string
		for time.Now().Before(deadline) {
			out, _, code, err := nodeimage.Exec(ctx, n.cli, n.id, "infermesh", "instances", "--json")
			last = out
			var is []admin.Instance
			if err == nil && code == 0 && json.Unmarshal([]byte(out), &is) == nil && len(is) == 1 && strings.Contains(is[0].LastError, want) {
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatalf("%s: no instance error with %q: %s", what, want, last)
	}
	instance("not in the docker group", "permission denied")
	gid := strings.TrimSpace(n.sh("stat -c %g /run/docker.sock"))
	n.sh("groupadd -g " + gid + " docker && usermod -aG docker infermesh && systemctl restart infermeshd")
	instance("in the docker group", "image not found")
	// Its own group, docker's, and the operators' admin group (the
	// sysusers file puts it there).
	groups := strings.Fields(n.sh("id -nG infermesh"))
	slices.Sort(groups)
	if !slices.Equal(groups, []string{"docker", "infermesh", "infermesh-admin"}) {
		t.Errorf("id -nG infermesh = %q, want infermesh, docker and infermesh-admin", groups)
	}
}
