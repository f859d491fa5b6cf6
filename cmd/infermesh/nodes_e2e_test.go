package main

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.etcd.io/bbolt"
	"golang.org/x/crypto/ssh"

	"github.com/infermesh/infermesh/agent"
	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/provision"
	"github.com/infermesh/infermesh/provision/node"
	"github.com/infermesh/infermesh/store"
)

// The stages of a successful docker add, in order.
var addStages = []string{"leasing", "created", "connecting", "ready", "stdout_streaming", "boot_checking", "agent_starting", "waiting_for_join", "converged"}

// stagesOf lists the distinct stages (or phases, before the session) a
// stream went through.
func stagesOf(evs []admin.NodeEvent) []string {
	var out []string
	for _, e := range evs {
		if e.Kind != admin.NodeEventStage {
			continue
		}
		s := e.Stage
		if s == "" {
			s = e.Phase
		}
		if len(out) == 0 || out[len(out)-1] != s {
			out = append(out, s)
		}
	}
	return out
}

// TestNodeAddDockerServesChatOverQUIC is the whole story: an agent
// bootstraps a docker node with the demo model; the node joins (admitted
// with the key made on it, its chat advert heard); the agent's loopback
// port serves a chat completion, driven by the OpenAI Go SDK, from the new
// node's role over QUIC; `node remove` leaves nothing behind.
func TestNodeAddDockerServesChatOverQUIC(t *testing.T) {
	e := newNodeEnv(t)
	a, sock := e.startAgent("hub")

	out, errOut, code := runCLI(t, "node", "add", "lab", "--provider", "docker", "--network", e.network,
		"--roles", "chat", "--demo", "--authority-key", e.authFile, "--json", "--socket", sock)
	if code != 0 {
		t.Fatalf("node add: exit %d: %s\n%s", code, errOut, out)
	}
	evs := nodeEvents(t, out)
	if got := stagesOf(evs); !slices.Equal(got, addStages) {
		t.Errorf("stages = %v\nwant     %v", got, addStages)
	}
	if last := evs[len(evs)-1]; last.Kind != admin.NodeEventDone {
		t.Errorf("last event = %+v, want done", last)
	}
	// One sequence over stdout and stderr, from 1, without gaps.
	var seqs []uint64
	streams := map[string]bool{}
	for _, ev := range evs {
		if ev.Kind == admin.NodeEventLog {
			seqs = append(seqs, ev.Seq)
			streams[ev.Stream] = true
		}
	}
	for i, s := range seqs {
		if s != uint64(i+1) {
			t.Fatalf("log sequence numbers %v: want 1, 2, 3, ...", seqs)
		}
	}
	if !streams["stdout"] || !streams["stderr"] {
		t.Errorf("log streams %v, want stdout and stderr", streams)
	}
	// Each stage is an audit event.
	var audited []string
	for _, ev := range a.Audit().Recent() {
		if ev.Node == "lab" && (ev.Kind == agent.AuditNodeStage || ev.Kind == agent.AuditNodeConverged) {
			s := ev.Fields["stage"]
			if s == "" {
				s = ev.Fields["phase"]
			}
			if len(audited) == 0 || audited[len(audited)-1] != s {
				audited = append(audited, s)
			}
		}
	}
	if !slices.Equal(audited, addStages) {
		t.Errorf("audited stages = %v\nwant            %v", audited, addStages)
	}

	// The node as the agent sees it.
	l := nodeList(t, sock)
	if len(l.Nodes) != 1 || l.Nodes[0].Phase != "converged" || l.Nodes[0].Member != "admitted" || l.Nodes[0].Installed == 0 {
		t.Fatalf("node list = %+v, want lab converged and admitted", l)
	}
	p, ok := member(a.Mesh(), "lab")
	if !ok || !p.Admitted || l.Nodes[0].Key == "" || l.Nodes[0].Key != identity.EncodeNodeKey(p.PublicKey) {
		t.Fatalf("mesh view of lab = %+v (%v), want admitted with the key made on the host (%s)", p, ok, l.Nodes[0].Key)
	}

	// A chat completion on the agent's loopback port: the agent has no
	// instance of chat, so the answer comes from lab over QUIC.
	cands := a.Table().Resolve("chat")
	if len(cands) == 0 || cands[0].Kind != placement.KindRemote || cands[0].Node != "lab" {
		t.Fatalf("chat resolves to %+v, want lab (remote)", cands)
	}
	addr, _ := a.RoleAddr("chat")
	client := openai.NewClient(option.WithBaseURL("http://"+addr.String()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "chat",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
	})
	if err != nil {
		t.Fatalf("chat completion through the agent: %v", err)
	}
	if len(resp.Choices) == 0 || resp.Choices[0].Message.Content == "" || resp.Model != "chat" {
		t.Fatalf("chat completion = %+v, want an answer for model chat", resp)
	}

	// Remove: the container goes, the record and the override too, and
	// the node leaves the mesh view.
	out, errOut, code = runCLI(t, "node", "remove", "lab", "--socket", sock)
	if code != 0 {
		t.Fatalf("node remove: exit %d: %s\n%s", code, errOut, out)
	}
	if !strings.Contains(out, "removed") {
		t.Errorf("node remove printed %q, want it to say removed", out)
	}
	e.assertGone(a, sock, "lab")
	if _, errOut, code := runCLI(t, "node", "remove", "lab", "--socket", sock); code == 0 || !strings.Contains(errOut, "no node lab") {
		t.Errorf("removing it again: exit %d %q, want a not-found error", code, errOut)
	}
}

// TestNodeAddFailingVerifyTearsDown: a verify command that fails ends the
// add at boot_check_failed, exit non-zero with the stage and reason, and
// leaves no container, no record, no override and no member.
func TestNodeAddFailingVerifyTearsDown(t *testing.T) {
	e := newNodeEnv(t)
	a, sock := e.startAgent("hub")
	out, errOut, code := runCLI(t, "node", "add", "bad", "--provider", "docker", "--network", e.network,
		"--roles", "chat", "--demo", "--authority-key", e.authFile, "--verify", "test -e /opt/gpu-driver", "--socket", sock)
	if code == 0 {
		t.Fatalf("node add with a failing verify succeeded:\n%s", out)
	}
	for _, want := range []string{"failed at stage boot_check_failed", "test -e /opt/gpu-driver", "exit 1"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr %q lacks %q", errOut, want)
		}
	}
	for _, want := range []string{"boot_checking", "failed", "destroyed"} {
		if !strings.Contains(out, want) {
			t.Errorf("progress lacks %q:\n%s", want, out)
		}
	}
	e.assertGone(a, sock, "bad")
}

// hostFiles lists every path of the host container's root filesystem
// (its own filesystem only: not /proc, /sys, /run or /dev), with its type.
func hostFiles(t *testing.T, cli *provision.DockerClient, id string) []string {
	t.Helper()
	out, errOut, code, err := nodeimage.Exec(context.Background(), cli, id, "find", "/", "-xdev", "-printf", "%y %p\n")
	if err != nil || code != 0 {
		t.Fatalf("find: exit %d %v %s", code, err, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	slices.Sort(lines)
	return lines
}

func diffLists(before, after []string) (added, removed []string) {
	b, a := map[string]bool{}, map[string]bool{}
	for _, x := range before {
		b[x] = true
	}
	for _, x := range after {
		a[x] = true
		if !b[x] {
			added = append(added, x)
		}
	}
	for _, x := range before {
		if !a[x] {
			removed = append(removed, x)
		}
	}
	return added, removed
}

// TestNodeSSHProvider runs the ssh provider against a real sshd: a node
// container stands in for an existing server. A wrong host key is refused
// before authentication and leaves the host untouched; an install pinned
// by known_hosts converges; `node remove` then leaves the host as it was,
// file for file.
func TestNodeSSHProvider(t *testing.T) {
	e := newNodeEnv(t)
	a, sock := e.startAgent("hub")
	bootstrapKey, err := node.ParseAuthorizedKey(nodeList(t, sock).BootstrapKey)
	if err != nil {
		t.Fatal(err)
	}
	_, hostKey, _ := ed25519.GenerateKey(rand.Reader)
	hostPub, _ := ssh.NewPublicKey(hostKey.Public())
	ctx := context.Background()
	id, err := nodeimage.Boot(ctx, e.cli, nodeimage.BootOptions{
		Tag: nodeImage, Name: "infermesh-test-" + e.site + "-host", Network: e.network,
		Labels:  map[string]string{provision.LabelSite: e.site, "io.infermesh.test": "existing-host"},
		HostKey: hostKey, AuthorizedKeys: []ssh.PublicKey{bootstrapKey},
	})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if _, err := nodeimage.WaitReady(wctx, e.cli, id); err != nil {
		t.Fatal(err)
	}
	// This host has Docker's group (the docker nodes of the other tests
	// have none): the agent's user joins it.
	if out, errOut, code, err := nodeimage.Exec(ctx, e.cli, id, "groupadd", "--system", "docker"); err != nil || code != 0 {
		t.Fatalf("groupadd docker: exit %d %v %s%s", code, err, out, errOut)
	}
	info, err := e.cli.ContainerInspect(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	ip := info.NetworkSettings.Networks[e.network].IPAddress

	// The agent logs in once before the baseline, so that what sshd
	// itself records about logins is in it.
	signer, err := node.LoadOrCreateSigner(filepath.Join(e.dir, "hub", agent.BootstrapKeyFile), "")
	if err != nil {
		t.Fatal(err)
	}
	c := node.NewSSHClient(node.SSHConfig{Signer: signer})
	if err := c.Connect(ctx, node.Endpoint{Host: ip, Port: 22, User: "root", HostKeys: []string{node.AuthorizedKey(hostPub)}}, nil); err != nil {
		t.Fatal(err)
	}
	c.Close()
	before := hostFiles(t, e.cli, id)
	accepted := func() int {
		out, _, _, _ := nodeimage.Exec(ctx, e.cli, id, "sh", "-c", "journalctl -u ssh --no-pager -o cat")
		if strings.Contains(out, "authenticating user") || strings.Contains(out, "Failed publickey") {
			t.Errorf("sshd saw a failed authentication:\n%s", out)
		}
		return strings.Count(out, "Accepted publickey")
	}
	logins := accepted()

	t.Run("wrong host key", func(t *testing.T) {
		wrong := ssh.FingerprintSHA256(mustSigner(t).PublicKey())
		out, errOut, code := runCLI(t, "node", "add", "h0", "--ssh", "root@"+ip, "--host-key-fingerprint", wrong,
			"--roles", "chat", "--demo", "--authority-key", e.authFile, "--socket", sock)
		if code == 0 {
			t.Fatalf("node add with a wrong host key succeeded:\n%s", out)
		}
		// Its own stage, and both keys: what the host presented, what
		// was pinned.
		if want := fmt.Sprintf("infermesh: node h0: add failed at stage host_key_mismatch: ssh connect: host key mismatch: %s:22 presented ssh-ed25519 %s, pinned: %s\n",
			ip, ssh.FingerprintSHA256(hostPub), wrong); errOut != want {
			t.Errorf("stderr = %q\nwant     %q", errOut, want)
		}
		if n := accepted(); n != logins {
			t.Errorf("sshd accepted %d logins, want %d: the wrong key was not refused before authentication", n, logins)
		}
		if added, removed := diffLists(before, hostFiles(t, e.cli, id)); len(added)+len(removed) > 0 {
			t.Errorf("the refused add changed the host: added %v, removed %v", added, removed)
		}
		e.assertGone(a, sock, "h0")
	})

	t.Run("malformed fingerprint", func(t *testing.T) {
		out, errOut, code := runCLI(t, "node", "add", "h0", "--ssh", "root@"+ip, "--host-key-fingerprint", "SHA256:nope",
			"--roles", "chat", "--demo", "--authority-key", e.authFile, "--socket", sock)
		// Refused before anything ran: no stage, no connection.
		want := `infermesh: node h0: add: --host-key-fingerprint: host key fingerprint "SHA256:nope" is not a SHA256 digest: want SHA256: followed by 43 base64 characters, as ssh-keygen -lf prints it (ssh-keyscan HOST | ssh-keygen -lf -)` + "\n"
		if code != exitFailure || out != "" || errOut != want {
			t.Errorf("node add with a malformed fingerprint = exit %d, stdout %q, stderr %q\nwant exit %d, nothing on stdout, %q", code, out, errOut, exitFailure, want)
		}
		if n := accepted(); n != logins {
			t.Errorf("sshd accepted %d logins, want %d", n, logins)
		}
		e.assertGone(a, sock, "h0")
	})

	t.Run("install and remove", func(t *testing.T) {
		knownHosts := filepath.Join(t.TempDir(), "known_hosts")
		line := knownhostsLine(ip, hostPub)
		if err := os.WriteFile(knownHosts, []byte(line), 0o600); err != nil {
			t.Fatal(err)
		}
		out, errOut, code := runCLI(t, "node", "add", "h1", "--ssh", "root@"+ip, "--known-hosts", knownHosts,
			"--roles", "chat", "--demo", "--authority-key", e.authFile, "--socket", sock)
		if code != 0 {
			t.Fatalf("node add --ssh: exit %d: %s\n%s", code, errOut, out)
		}
		p, ok := member(a.Mesh(), "h1")
		if !ok || !p.Admitted {
			t.Fatalf("h1 in the mesh view: %+v %v, want admitted", p, ok)
		}
		installed, _ := diffLists(before, hostFiles(t, e.cli, id))
		for _, want := range []string{"f /usr/local/bin/infermeshd", "f /usr/local/bin/infermesh", "f /etc/infermesh/infermesh.yaml", "f /var/lib/infermesh/node.key", "l /etc/systemd/system/multi-user.target.wants/infermeshd.service"} {
			if !slices.Contains(installed, want) {
				t.Errorf("after the install the host lacks %s (added: %v)", want, installed)
			}
		}
		// The agent runs as its own user, in the docker group and the
		// operators' admin group; the config is root's, readable by the
		// agent's group; its state is its own.
		out, _, _, _ = nodeimage.Exec(ctx, e.cli, id, "sh", "-c",
			`pid=$(systemctl show -p MainPID --value infermeshd); ps -o user= -p $pid; id -nG infermesh; grep -E '^Groups:' /proc/$pid/status | tr -d '\t'; getent group docker | cut -d: -f3; stat -c '%U:%G %a' /etc/infermesh/infermesh.yaml; find /var/lib/infermesh ! -user infermesh`)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		groups := []string{}
		if len(lines) > 1 {
			groups = strings.Fields(lines[1])
			slices.Sort(groups)
		}
		if len(lines) != 5 || lines[0] != "infermesh" || !slices.Equal(groups, []string{"docker", "infermesh", "infermesh-admin"}) || !slices.Contains(strings.Fields(strings.TrimPrefix(lines[2], "Groups:")), lines[3]) ||
			lines[4] != "root:infermesh 640" {
			t.Errorf("agent user, its groups, the agent's groups, docker's gid, the config's owner, state not the agent's:\n%s\nwant infermesh, in docker and infermesh-admin, config root:infermesh 640, all state the agent's", out)
		}
		// An operator who logs in runs infermesh there: the CLI beside
		// the agent reaches it on its default socket. Root, and a user in
		// the admin group, are answered; a user outside it is told which
		// group to join (exit 77).
		sc := node.NewSSHClient(node.SSHConfig{Signer: signer})
		if err := sc.Connect(ctx, node.Endpoint{Host: ip, Port: 22, User: "root", HostKeys: []string{node.AuthorizedKey(hostPub)}}, nil); err != nil {
			t.Fatal(err)
		}
		onHost := func(line string) (string, int) {
			t.Helper()
			var b strings.Builder
			collect := func(l string) { b.WriteString(l + "\n") }
			code, err := sc.Run(ctx, node.RemoteCommand{Line: line, Stdout: collect, Stderr: collect})
			if err != nil {
				t.Fatalf("%s on the host: %v", line, err)
			}
			return b.String(), code
		}
		for _, line := range []string{
			"infermesh status",
			"setpriv --reuid=nobody --regid=nogroup --groups=infermesh-admin infermesh status",
		} {
			if out, code := onHost(line); code != 0 || !strings.Contains(out, "node          h1\n") {
				t.Errorf("%s on the host = exit %d:\n%s\nwant the node agent's status", line, code, out)
			}
		}
		out, code = onHost("setpriv --reuid=nobody --regid=nogroup --clear-groups infermesh status")
		if code != exitNoPerm || !strings.Contains(out, "infermesh: permission denied: you are not in group infermesh-admin, which owns /run/infermesh") {
			t.Errorf("infermesh status on the host by a user outside infermesh-admin = exit %d:\n%s\nwant %d, which group to join", code, out, exitNoPerm)
		}
		sc.Close()

		out, errOut, code = runCLI(t, "node", "remove", "h1", "--socket", sock)
		if code != 0 {
			t.Fatalf("node remove: exit %d: %s\n%s", code, errOut, out)
		}
		if added, removed := diffLists(before, hostFiles(t, e.cli, id)); len(added)+len(removed) > 0 {
			t.Errorf("after remove the host differs: added %v, removed %v", added, removed)
		}
		if state, _, _, _ := nodeimage.Exec(ctx, e.cli, id, "systemctl", "is-active", "infermeshd.service"); strings.TrimSpace(state) == "active" {
			t.Error("infermeshd still runs on the host")
		}
		e.assertGone(a, sock, "h1")
	})
}

func mustSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, k, _ := ed25519.GenerateKey(rand.Reader)
	s, err := ssh.NewSignerFromKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func knownhostsLine(ip string, k ssh.PublicKey) string {
	return fmt.Sprintf("%s %s", ip, ssh.MarshalAuthorizedKey(k))
}

// TestNodeAddAgentKilled: the bootstrapping agent (infermeshd, its own
// process) is killed with SIGKILL while the session installs. The intent
// it stored before the lease survives the crash; the restarted agent tears
// the node down: no container, no record, no override, no member.
func TestNodeAddAgentKilled(t *testing.T) {
	e := newNodeEnv(t)
	cfgPath, sock := e.writeAgentConfig("hub")
	logPath := filepath.Join(e.dir, "hub.log")
	start := func() *exec.Cmd {
		t.Helper()
		logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(nodeBins["infermeshd"], "-config", cfgPath)
		cmd.Stdout, cmd.Stderr = logf, logf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		logf.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
		if _, errOut, code := runCLI(t, "status", "--wait", "30s", "--socket", sock); code != 0 {
			log, _ := os.ReadFile(logPath)
			t.Fatalf("the agent did not come up: %s\n%s", errOut, log)
		}
		return cmd
	}
	first := start()

	pr, pw := io.Pipe()
	var errOut strings.Builder
	codec := make(chan int, 1)
	go func() {
		code := run([]string{"node", "add", "k1", "--provider", "docker", "--network", e.network, "--roles", "chat", "--demo",
			"--authority-key", e.authFile, "--json", "--socket", sock}, pw, &errOut)
		pw.Close()
		codec <- code
	}()
	killed := false
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		var ev admin.NodeEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("stream line %q: %v", sc.Text(), err)
		}
		if ev.Stage == "agent_starting" && !killed {
			if err := first.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			killed = true
		}
	}
	code := <-codec
	if !killed {
		t.Fatalf("the add never reached agent_starting (exit %d: %s)", code, errOut.String())
	}
	if code == 0 || !strings.Contains(errOut.String(), "node k1") {
		t.Fatalf("node add after its agent died: exit %d %q, want a failure naming the node", code, errOut.String())
	}

	// What the crash left: the container, and its intent in the state
	// store (written before the lease was created).
	ctx := context.Background()
	left := 0
	for _, c := range e.containers(ctx) {
		if c.Labels[provision.LabelNode] == "k1" {
			left++
		}
	}
	if left != 1 {
		t.Fatalf("%d containers of k1 after the crash, want 1", left)
	}
	waitFor(t, 10*time.Second, "the dead agent's state store lock", func() bool {
		db, err := bbolt.Open(filepath.Join(e.dir, "hub", "state.db"), 0o600, &bbolt.Options{ReadOnly: true, Timeout: 100 * time.Millisecond})
		if err != nil {
			return false
		}
		defer db.Close()
		return db.View(func(tx *bbolt.Tx) error {
			b := tx.Bucket([]byte(store.NodeIntents.Name()))
			if b == nil || b.Get([]byte("k1")) == nil {
				t.Fatal("no intent of k1 in the crashed agent's state store")
			}
			return nil
		}) == nil
	})

	start()
	waitFor(t, 2*time.Minute, "the restarted agent to tear k1 down", func() bool {
		return len(nodeList(t, sock).Nodes) == 0
	})
	// Recovery drops the overrides of adds that left no node once the
	// teardown is over, a moment after the record went.
	waitFor(t, 30*time.Second, "the restarted agent to drop k1's override", func() bool {
		out, _, _ := runCLI(t, "policy", "list", "--json", "--socket", sock)
		return !strings.Contains(out, `"node": "k1"`)
	})
	e.assertGone(nil, sock, "k1")
	waitFor(t, 30*time.Second, "k1 gone from the restarted agent's mesh view", func() bool {
		out, _, _ := runCLI(t, "peers", "--json", "--socket", sock)
		return !strings.Contains(out, `"name": "k1"`)
	})
}

// TestNodeAddClosedPortShowsRetries: `node add --ssh` to a port nothing
// listens on shows each failed attempt as it happens (attempt n, why, when
// the next is) in the progress output, then fails at stage
// ssh_unreachable saying "connection refused", and tears down. The
// retries are not audited one by one; the failure is.
func TestNodeAddClosedPortShowsRetries(t *testing.T) {
	e := newNodeEnv(t)
	e.connectTimeout = 4 * time.Second
	a, sock := e.startAgent("hub")
	port := testnet.TCPPort(t, e.gateway) // free: nothing listens
	addr := fmt.Sprintf("%s:%d", e.gateway, port)
	fp := ssh.FingerprintSHA256(mustSigner(t).PublicKey())
	out, errOut, code := runCLI(t, "node", "add", "closed", "--ssh", "root@"+addr, "--host-key-fingerprint", fp,
		"--roles", "chat", "--demo", "--authority-key", e.authFile, "--socket", sock)
	if code != exitFailure {
		t.Fatalf("node add to a closed port = exit %d, want %d:\n%s%s", code, exitFailure, out, errOut)
	}
	for _, want := range []string{
		"root@" + addr + ": attempt 1 failed: connection refused; next in ",
		"root@" + addr + ": attempt 2 failed: connection refused; next in ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("progress lacks %q:\n%s", want, out)
		}
	}
	if !regexp.MustCompile(`(?m)^\d\d:\d\d:\d\d connecting +root@`).MatchString(out) {
		t.Errorf("the retries are not stage lines of connecting:\n%s", out)
	}
	wantErr := regexp.MustCompile(`^infermesh: node closed: add failed at stage ssh_unreachable: ssh connect: ` + regexp.QuoteMeta(addr) +
		`: connection refused, \d+ attempt\(s\) in 4s \(is sshd listening there\?\)` + "\n$")
	if !wantErr.MatchString(errOut) {
		t.Errorf("stderr = %q, want it to match %s", errOut, wantErr)
	}
	e.assertGone(a, sock, "closed")
	for _, ev := range a.Audit().Recent() {
		if ev.Node == "closed" && strings.Contains(ev.Fields["message"], "attempt ") && ev.Kind == agent.AuditNodeStage {
			t.Errorf("a retry was audited: %+v", ev)
		}
	}

	// --json: each retry is a stage event with its attempt number.
	out, _, _ = runCLI(t, "node", "add", "closed", "--ssh", "root@"+addr, "--host-key-fingerprint", fp,
		"--roles", "chat", "--demo", "--authority-key", e.authFile, "--json", "--socket", sock)
	attempts := 0
	for _, ev := range nodeEvents(t, out) {
		if ev.Kind == admin.NodeEventStage && ev.Stage == "connecting" && ev.Attempt > 0 {
			attempts++
			if ev.Attempt != attempts {
				t.Errorf("retry event %d has attempt %d", attempts, ev.Attempt)
			}
		}
	}
	if attempts < 2 {
		t.Errorf("%d retry events in the JSON stream, want 2 or more:\n%s", attempts, out)
	}
	e.assertGone(a, sock, "closed")
}
