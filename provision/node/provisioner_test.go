package node

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestMain(m *testing.M) { runTests(m) }

// TestStartRunsEveryStageAndStoresIntentFirst: a bootstrap that succeeds
// passes the stages in order, the intent is in the store before the lease
// is created, and the node waits for its join.
func TestStartRunsEveryStageAndStoresIntentFirst(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.lease.onCreate = func(s Spec) {
		rec, ok := h.intents.get(s.Name)
		if !ok || rec.Phase != PhaseLeasing {
			t.Errorf("at lease creation the intent is %+v (stored %v), want phase leasing", rec, ok)
		}
	}
	if err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall())); err != nil {
		t.Fatalf("Start: %v", err)
	}
	var stages []string
	for _, r := range h.changes {
		if r.Stage != "" && (len(stages) == 0 || stages[len(stages)-1] != string(r.Stage)) {
			stages = append(stages, string(r.Stage))
		}
	}
	want := "created connecting ready stdout_streaming boot_checking agent_starting waiting_for_join"
	if got := strings.Join(stages, " "); got != want {
		t.Errorf("stages = %s, want %s", got, want)
	}
	rec, _ := h.p.Record()
	if rec.Phase != PhaseWaitingForJoin || rec.PublicKey != fakeNodeKey {
		t.Errorf("record = phase %s key %q, want waiting_for_join with the key read back", rec.Phase, rec.PublicKey)
	}
	if stored, ok := h.intents.get("gpu-7"); !ok || stored.Phase != PhaseWaitingForJoin {
		t.Errorf("stored intent = %+v, %v; want phase waiting_for_join", stored.Phase, ok)
	}
	if h.client.closed.Load() {
		t.Error("the client closed before convergence")
	}
	if h.sink.flushes != 0 {
		t.Error("the sink was flushed before convergence")
	}
}

// TestInstallRecordsBeforeCreating: each directory, file and unit is in the
// stored intent before the command creating it runs.
func TestInstallRecordsBeforeCreating(t *testing.T) {
	h := newHarness(t, KindSSH)
	h.client.reply = func(line string, _ []byte) ([]string, []string, int, error) {
		rec, _ := h.intents.get("gpu-7")
		var have []string
		if rec.Lease != nil {
			for _, it := range rec.Lease.Installed {
				have = append(have, it.Path)
			}
		}
		for _, p := range []string{"/etc/sysusers.d", "/etc/sysusers.d/infermesh.conf", "/var/lib/infermesh", "/etc/infermesh", "/etc/infermesh/infermesh.yaml", "/var/lib/infermesh/node.cert", "infermeshd.service"} {
			creates := strings.Contains(line, "install -d") || strings.Contains(line, "cat > ") || strings.Contains(line, "enable --now")
			if creates && strings.Contains(line, shellQuote(p)) && !strings.Contains(strings.Join(have, " "), p) {
				t.Errorf("%q ran before %s was recorded (recorded: %v)", line, p, have)
			}
		}
		return nil, nil, 0, nil
	}
	if err := h.p.Start(context.Background(), testSpec(KindSSH), fixed(testInstall())); err != nil {
		t.Fatal(err)
	}
	rec, _ := h.intents.get("gpu-7")
	var got []string
	for _, it := range rec.Lease.Installed {
		got = append(got, it.Kind+":"+it.Path)
	}
	want := "parent:/etc/sysusers.d file:/etc/sysusers.d/infermesh.conf dir:/var/lib/infermesh dir:/etc/infermesh file:/etc/infermesh/infermesh.yaml file:/etc/systemd/system/infermeshd.service file:/var/lib/infermesh/node.cert unit:infermeshd.service"
	if strings.Join(got, " ") != want {
		t.Errorf("installed = %s\nwant        %s", strings.Join(got, " "), want)
	}
}

// TestLogSequenceNumbers: one sequence shared by stdout and stderr,
// starting at 1, each record carrying run, node and lease; the machine
// tracks the last of each stream.
func TestLogSequenceNumbers(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.client.reply = func(line string, _ []byte) ([]string, []string, int, error) {
		switch {
		case strings.Contains(line, "os-release"):
			return []string{"NAME=Debian", "VERSION=12"}, []string{"warn: x"}, 0, nil
		case strings.Contains(line, "systemctl --failed"):
			return []string{"ssh.service failed"}, nil, 0, nil
		}
		return nil, nil, 0, nil
	}
	if err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(Install{})); err != nil {
		t.Fatal(err)
	}
	want := []struct {
		stream Stream
		line   string
	}{{Stdout, "NAME=Debian"}, {Stdout, "VERSION=12"}, {Stderr, "warn: x"}, {Stderr, "ssh.service failed"}}
	if len(h.sink.records) != len(want) {
		t.Fatalf("records = %+v, want %d", h.sink.records, len(want))
	}
	for i, r := range h.sink.records {
		if r.Seq != uint64(i+1) || r.Stream != want[i].stream || r.Line != want[i].line {
			t.Errorf("record %d = seq %d %s %q, want seq %d %s %q", i, r.Seq, r.Stream, r.Line, i+1, want[i].stream, want[i].line)
		}
		if r.Run != 42 || r.Node != "gpu-7" || r.Lease != "docker:c1" || r.Source != SourceSSHBootstrap {
			t.Errorf("record %d = %+v, want run 42, node gpu-7, lease docker:c1, source ssh_bootstrap", i, r)
		}
	}
	rec, _ := h.p.Record()
	if rec.LastStdoutSeq != 2 || rec.LastStderrSeq != 4 {
		t.Errorf("last seqs = stdout %d stderr %d, want 2 and 4", rec.LastStdoutSeq, rec.LastStderrSeq)
	}
	if so, se := h.p.Session().LastSeqs(); so != 2 || se != 4 {
		t.Errorf("session last seqs = %d %d, want 2 4", so, se)
	}
}

// TestConvergenceFlushesAndCloses: the join observed, the sink is flushed
// once, the client closed, the session closed and the node converged.
func TestConvergenceFlushesAndCloses(t *testing.T) {
	h := newHarness(t, KindDocker)
	ctx := context.Background()
	if err := h.p.Start(ctx, testSpec(KindDocker), fixed(testInstall())); err != nil {
		t.Fatal(err)
	}
	if err := h.p.ObserveJoin(ctx, "gpu-7"); err != nil {
		t.Fatalf("ObserveJoin: %v", err)
	}
	if h.sink.flushes != 1 || !h.client.closed.Load() || !h.p.Session().Closed() || h.p.Session().Stage() != StageClosed {
		t.Errorf("after convergence: flushes %d, client closed %v, session closed %v at %s; want 1, true, true, closed",
			h.sink.flushes, h.client.closed.Load(), h.p.Session().Closed(), h.p.Session().Stage())
	}
	rec, _ := h.p.Record()
	if !h.p.Ready() || rec.Phase != PhaseConverged || rec.Member != "gpu-7" || rec.SessionOpen {
		t.Errorf("record = %+v, want converged as gpu-7 with the session closed", rec)
	}
	if len(h.lease.destroyCalls()) != 0 {
		t.Error("a converged node was torn down")
	}
	// A second join is refused (ErrNode) and changes nothing.
	if err := h.p.ObserveJoin(ctx, "gpu-7"); !errors.Is(err, ErrNode) {
		t.Errorf("second ObserveJoin = %v, want ErrNode", err)
	}
}

// TestCancelDoesNotFlush: stopping a node waiting for its join cancels the
// session (the client closes) without flushing the sink, and destroys the
// lease.
func TestCancelDoesNotFlush(t *testing.T) {
	h := newHarness(t, KindDocker)
	if err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall())); err != nil {
		t.Fatal(err)
	}
	if err := h.p.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !h.client.closed.Load() || h.p.Session().Stage() != StageCancelled || h.sink.flushes != 0 {
		t.Errorf("after stop: client closed %v, stage %s, flushes %d; want true, cancelled, 0",
			h.client.closed.Load(), h.p.Session().Stage(), h.sink.flushes)
	}
	if d := h.lease.destroyCalls(); len(d) != 1 || d[0].LeaseID != "docker:c1" {
		t.Errorf("destroy calls = %+v, want one for docker:c1", d)
	}
	if _, ok := h.intents.get("gpu-7"); ok {
		t.Error("the intent outlived the teardown")
	}
}

// TestContextCancelMidSession: the caller's context ending while a command
// runs ends the session at stage cancelled; the node is torn down.
func TestContextCancelMidSession(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.client.block = "test -d /run/systemd/system"
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for !strings.Contains(strings.Join(h.client.ran(), "\n"), "test -d /run/systemd") {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	err := h.p.Start(ctx, testSpec(KindDocker), fixed(testInstall()))
	var ne *Error
	if !errors.As(err, &ne) || !errors.Is(err, ErrBootstrap) || ne.Stage != StageCancelled {
		t.Fatalf("Start = %v, want ErrBootstrap at cancelled", err)
	}
	if h.sink.flushes != 0 || !h.client.closed.Load() || len(h.lease.destroyCalls()) != 1 {
		t.Errorf("flushes %d, closed %v, destroys %d; want 0, true, 1", h.sink.flushes, h.client.closed.Load(), len(h.lease.destroyCalls()))
	}
}

// TestEachStageFailure: every step's failure ends at its stage with its
// message, and tears the lease down, returning the original error.
func TestEachStageFailure(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		connect error
		fail    string // a command matching this exits 1 with stderr "nope"
		stage   Stage
		reason  string
	}{
		{name: "connect", connect: boom, stage: StageSSHTimeout, reason: "ssh connect: boom"},
		{name: "connect refused", connect: &ConnectError{Addr: "10.9.0.2:22", Stage: StageSSHUnreachable, Attempts: 3, Elapsed: 2 * time.Second, Err: boom},
			stage: StageSSHUnreachable, reason: "ssh connect: 10.9.0.2:22: boom, 3 attempt(s) in 2s (is sshd listening there?)"},
		{name: "host key", connect: fmt.Errorf("%w: 10.9.0.2:22 presented ssh-ed25519 SHA256:a, pinned: SHA256:b", ErrHostKeyMismatch),
			stage: StageHostKeyMismatch, reason: "ssh connect: host key mismatch: 10.9.0.2:22 presented ssh-ed25519 SHA256:a, pinned: SHA256:b"},
		{name: "auth", connect: fmt.Errorf("%w: 10.9.0.2:22 as root", ErrAuthFailed), stage: StageSSHAuthFailed, reason: "ssh connect: the host refused this agent's ssh key"},
		{name: "probe", fail: "echo infermesh-probe", stage: StageProbeFailed, reason: "ssh probe:"},
		{name: "stdout source", fail: "os-release", stage: StageStreamError, reason: "bootstrap log stream: cat /etc/os-release: exit 1: nope"},
		{name: "stderr source", fail: "systemctl --failed", stage: StageStreamError, reason: "bootstrap log stream: systemctl --failed: exit 1"},
		{name: "verify", fail: "test -d /run/systemd/system", stage: StageBootCheckFailed, reason: "boot check failed: systemd: the host does not run systemd (exit 1: nope)"},
		{name: "keygen", fail: "-keygen", stage: StageStartFailed, reason: "agent start failed: node key: exit 1: nope"},
		{name: "unit", fail: "enable --now", stage: StageStartFailed, reason: "agent start failed: systemctl enable --now infermeshd.service: exit 1: nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, KindDocker)
			h.client.connectErr = tc.connect
			if tc.fail != "" {
				h.client.reply = func(line string, _ []byte) ([]string, []string, int, error) {
					if strings.Contains(line, tc.fail) {
						return nil, []string{"nope"}, 1, nil
					}
					return nil, nil, 0, nil
				}
			}
			err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall()))
			var ne *Error
			if !errors.As(err, &ne) || !errors.Is(err, ErrBootstrap) {
				t.Fatalf("Start = %v, want an ErrBootstrap *Error", err)
			}
			if ne.Stage != tc.stage || !strings.HasPrefix(ne.Reason, tc.reason) || ne.Node != "gpu-7" {
				t.Errorf("error = stage %s reason %q node %s, want stage %s reason %q... node gpu-7", ne.Stage, ne.Reason, ne.Node, tc.stage, tc.reason)
			}
			if !strings.Contains(err.Error(), string(tc.stage)) {
				t.Errorf("message %q does not name the stage", err)
			}
			if d := h.lease.destroyCalls(); len(d) != 1 {
				t.Errorf("destroy calls = %d, want 1 (teardown)", len(d))
			}
			if !h.client.closed.Load() {
				t.Error("the session's client was not closed by the teardown")
			}
			if _, ok := h.intents.get("gpu-7"); ok {
				t.Error("the intent outlived the teardown")
			}
			if h.sink.flushes != 0 {
				t.Error("a failed session flushed its sink")
			}
		})
	}
}

// TestEndpointUnavailable: a lease without an endpoint fails with the
// lease named, and is destroyed.
func TestEndpointUnavailable(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.lease.noEndpoint, h.lease.lookupFails = true, true
	err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall()))
	var ne *Error
	if !errors.As(err, &ne) || !errors.Is(err, ErrEndpointUnavailable) || ne.Lease != "docker:c1" {
		t.Fatalf("Start = %v, want ErrEndpointUnavailable for docker:c1", err)
	}
	if d := h.lease.destroyCalls(); len(d) != 1 || d[0].LeaseID != "docker:c1" {
		t.Errorf("destroy = %+v, want the lease destroyed", d)
	}
	if len(h.client.ran()) != 0 {
		t.Error("a session ran without an endpoint")
	}
}

// TestProviderFailureTearsDownByName: a lease whose creation failed part
// way is destroyed by the node's name (the provider finds what it made).
func TestProviderFailureTearsDownByName(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.lease.createErr = errors.New("no space left")
	err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall()))
	if !errors.Is(err, ErrProvider) || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("Start = %v, want ErrProvider with the reason", err)
	}
	if d := h.lease.destroyCalls(); len(d) != 1 || d[0].LeaseID != "" || d[0].Node != "gpu-7" {
		t.Errorf("destroy = %+v, want one by node name", d)
	}
}

// TestWrongProviderSpecRefused: a spec of another kind is the provider's
// to refuse; the refusal is a provider error.
func TestWrongProviderSpecRefused(t *testing.T) {
	h := newHarness(t, KindDocker)
	err := h.p.Start(context.Background(), testSpec(KindSSH), fixed(testInstall()))
	if !errors.Is(err, ErrProvider) {
		t.Fatalf("Start = %v, want ErrProvider", err)
	}
}

// TestTeardownFailureKeepsIntent: when the teardown fails too, the
// original error is returned (with the teardown's), and the intent stays
// for a later remove.
func TestTeardownFailureKeepsIntent(t *testing.T) {
	h := newHarness(t, KindDocker)
	h.client.connectErr = errors.New("refused")
	h.lease.destroyErr = errors.New("daemon gone")
	err := h.p.Start(context.Background(), testSpec(KindDocker), fixed(testInstall()))
	var ne *Error
	if !errors.As(err, &ne) || !errors.Is(err, ErrBootstrap) || ne.Teardown == nil || !strings.Contains(err.Error(), "daemon gone") {
		t.Fatalf("Start = %v, want the bootstrap error with the teardown's attached", err)
	}
	if rec, ok := h.intents.get("gpu-7"); !ok || rec.Phase != PhaseDestroying {
		t.Errorf("intent = %+v, %v; want kept in phase destroying", rec.Phase, ok)
	}
	// Close retries the teardown (its rule: not complete).
	h.lease.destroyErr = nil
	if err := h.p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := h.intents.get("gpu-7"); ok {
		t.Error("Close did not finish the teardown")
	}
}

func TestStopBeforeStartIsNoOp(t *testing.T) {
	h := newHarness(t, KindDocker)
	if err := h.p.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := h.p.Close(); err != nil {
		t.Fatal(err)
	}
	if len(h.lease.destroyCalls()) != 0 || len(h.lease.created) != 0 || len(h.changes) != 0 {
		t.Error("stop before start touched something")
	}
}

// TestCloseCarriesDropsRule: Close tears down what is not torn down (a
// node waiting to join, a converged node it still owns) and nothing after
// a Stop.
func TestCloseCarriesDropsRule(t *testing.T) {
	for _, converge := range []bool{false, true} {
		t.Run(fmt.Sprintf("converged=%v", converge), func(t *testing.T) {
			h := newHarness(t, KindDocker)
			ctx := context.Background()
			if err := h.p.Start(ctx, testSpec(KindDocker), fixed(testInstall())); err != nil {
				t.Fatal(err)
			}
			if converge {
				if err := h.p.ObserveJoin(ctx, "gpu-7"); err != nil {
					t.Fatal(err)
				}
			}
			if err := h.p.Close(); err != nil {
				t.Fatal(err)
			}
			if err := h.p.Close(); err != nil {
				t.Fatal(err)
			}
			if d := h.lease.destroyCalls(); len(d) != 1 {
				t.Errorf("destroy calls after two Closes = %d, want 1", len(d))
			}
		})
	}
}

// TestUnexpectedCommand: lifecycle commands outside stop, and start
// commands inside it, are refused.
func TestUnexpectedCommand(t *testing.T) {
	h := newHarness(t, KindDocker)
	err := h.p.process(context.Background(), []Command{CmdDestroyLease{}})
	if !errors.Is(err, ErrUnexpectedCommand) || !strings.Contains(err.Error(), "outside stop") {
		t.Errorf("process(DestroyLease) = %v, want ErrUnexpectedCommand", err)
	}
	err = h.p.process(context.Background(), []Command{CmdCancelBootstrap{}})
	if !errors.Is(err, ErrUnexpectedCommand) {
		t.Errorf("process(CancelBootstrap) = %v, want ErrUnexpectedCommand", err)
	}
	err = h.p.processStop(context.Background(), []Command{CmdCreateLease{}})
	if !errors.Is(err, ErrUnexpectedCommand) || !strings.Contains(err.Error(), "unexpected stop command") {
		t.Errorf("processStop(CreateLease) = %v, want ErrUnexpectedCommand", err)
	}
	if len(h.lease.created) != 0 {
		t.Error("a refused command ran")
	}
}

// TestCommandsRunLastInFirstOut: of two pending commands the last runs
// first, so a missing session is found before the lease is created.
func TestCommandsRunLastInFirstOut(t *testing.T) {
	h := newHarness(t, KindDocker)
	err := h.p.process(context.Background(), []Command{CmdCreateLease{Spec: testSpec(KindDocker)}, CmdConvergenceObserved{Member: "gpu-7"}})
	if !errors.Is(err, ErrMissingBootstrap) {
		t.Fatalf("process = %v, want ErrMissingBootstrap from the last command", err)
	}
	if len(h.lease.created) != 0 {
		t.Error("the first command ran before the last")
	}
}

// TestMissingBootstrap: a node adopted from the store waiting for its join
// has no session; observing its join is the missing-bootstrap error.
func TestMissingBootstrap(t *testing.T) {
	h := newHarness(t, KindDocker)
	rec := Record{Spec: testSpec(KindDocker), Phase: PhaseWaitingForJoin, Lease: &LeaseFacts{Provider: KindDocker, ID: "docker:c1", ContractID: "c1"}}
	p, err := Adopt(ProvisionerConfig{Lease: h.lease, Clients: fakeFactory{h.client}, Intents: h.intents}, rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ObserveJoin(context.Background(), "gpu-7"); !errors.Is(err, ErrMissingBootstrap) {
		t.Fatalf("ObserveJoin = %v, want ErrMissingBootstrap", err)
	}
	if err := p.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d := h.lease.destroyCalls(); len(d) != 1 || d[0].ContractID != "c1" {
		t.Errorf("destroy = %+v, want c1", d)
	}
}

func TestSudoForNonRootUsers(t *testing.T) {
	h := newHarness(t, KindSSH)
	lease := &fakeLease{kind: KindSSH}
	p, _ := NewProvisioner(ProvisionerConfig{Lease: sshUserLease{lease, "ops"}, Clients: fakeFactory{h.client}})
	if err := p.Start(context.Background(), testSpec(KindSSH), fixed(testInstall())); err != nil {
		t.Fatal(err)
	}
	for _, l := range h.client.ran() {
		if strings.HasPrefix(l, "echo infermesh-probe") {
			continue
		}
		if !strings.HasPrefix(l, "sudo -n -- sh -c '") {
			t.Errorf("command %q runs without sudo as user ops", l)
		}
	}
}

// sshUserLease returns endpoints logging in as user.
type sshUserLease struct {
	*fakeLease
	user string
}

func (l sshUserLease) Create(ctx context.Context, s Spec) (LeaseFacts, *Endpoint, error) {
	f, ep, err := l.fakeLease.Create(ctx, s)
	if ep != nil {
		ep.User = l.user
	}
	return f, ep, err
}
