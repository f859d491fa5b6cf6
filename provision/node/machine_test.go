package node

import (
	"strings"
	"testing"
)

func TestMachineRefusesMessagesOutOfPhase(t *testing.T) {
	spec := testSpec(KindDocker)
	lease := LeaseFacts{Provider: KindDocker, ID: "docker:c1", ContractID: "c1"}
	ep := Endpoint{Host: "10.0.0.2", Port: 22, User: "root"}
	started := func() *Machine {
		m := NewMachine()
		if _, err := m.Handle(MsgStart{Spec: spec}); err != nil {
			t.Fatal(err)
		}
		return m
	}
	for _, tc := range []struct {
		name string
		m    func() *Machine
		msg  Msg
	}{
		{"lease before start", NewMachine, MsgLeaseCreated{Lease: lease, Endpoint: &ep}},
		{"second start", started, MsgStart{Spec: spec}},
		{"endpoint while leasing", started, MsgEndpointKnown{Endpoint: ep}},
		{"join while leasing", started, MsgJoined{Member: "gpu-7"}},
		{"observation while leasing", started, MsgBootstrapObserved{Observation: Observation{Stage: StageReady}}},
		{"lease destroyed while leasing", started, MsgLeaseDestroyed{}},
		{"converged before waiting", func() *Machine {
			m := started()
			_, _ = m.Handle(MsgLeaseCreated{Lease: lease, Endpoint: &ep})
			return m
		}, MsgBootstrapObserved{Observation: Observation{Stage: StageConverged}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := tc.m()
			before, _ := m.Record()
			cmds, err := m.Handle(tc.msg)
			if err == nil || cmds != nil {
				t.Fatalf("Handle(%T) = %v, %v; want refused", tc.msg, cmds, err)
			}
			after, _ := m.Record()
			if before.Phase != after.Phase {
				t.Errorf("a refused message moved the phase %s -> %s", before.Phase, after.Phase)
			}
		})
	}
}

func TestMachineHappyPathCommands(t *testing.T) {
	m := NewMachine()
	lease := LeaseFacts{Provider: KindDocker, ID: "docker:c1", ContractID: "c1"}
	ep := Endpoint{Host: "10.0.0.2", Port: 22, User: "root"}
	step := func(msg Msg) []Command {
		t.Helper()
		cmds, err := m.Handle(msg)
		if err != nil {
			t.Fatalf("Handle(%T): %v", msg, err)
		}
		return cmds
	}
	if c := step(MsgStart{Spec: testSpec(KindDocker)}); len(c) != 1 {
		t.Fatalf("start: %v", c)
	} else if _, ok := c[0].(CmdCreateLease); !ok {
		t.Fatalf("start: %T, want CmdCreateLease", c[0])
	}
	c := step(MsgLeaseCreated{Lease: lease})
	if lk, ok := c[0].(CmdLookupEndpoint); !ok || lk.Lease.ID != "docker:c1" {
		t.Fatalf("lease without endpoint: %v, want CmdLookupEndpoint", c)
	}
	c = step(MsgEndpointKnown{Endpoint: ep})
	if sb, ok := c[0].(CmdStartBootstrap); !ok || sb.Endpoint.Host != "10.0.0.2" || sb.Lease != "docker:c1" {
		t.Fatalf("endpoint known: %v, want CmdStartBootstrap", c)
	}
	step(MsgInstalled{Item: Installed{Kind: InstalledDir, Path: "/etc/infermesh"}})
	step(MsgBootstrapObserved{Observation: Observation{Stage: StageWaitingForJoin, LastStdoutSeq: 3, LastStderrSeq: 5}})
	c = step(MsgJoined{Member: "gpu-7"})
	if co, ok := c[0].(CmdConvergenceObserved); !ok || co.Member != "gpu-7" {
		t.Fatalf("joined: %v", c)
	}
	step(MsgBootstrapObserved{Observation: Observation{Stage: StageConverged}})
	step(MsgBootstrapClosed{})
	rec, _ := m.Record()
	if rec.Phase != PhaseConverged || rec.LastStdoutSeq != 3 || rec.LastStderrSeq != 5 || rec.SessionOpen {
		t.Errorf("record = %+v", rec)
	}
	// Destroying a converged node (session closed): no cancel, the lease
	// with what was installed.
	c = step(MsgDestroy{})
	if len(c) != 1 {
		t.Fatalf("destroy: %v, want only CmdDestroyLease", c)
	}
	d := c[0].(CmdDestroyLease)
	if d.Handle.LeaseID != "docker:c1" || len(d.Handle.Installed) != 1 || d.Handle.Endpoint == nil {
		t.Errorf("destroy handle = %+v", d.Handle)
	}
	step(MsgLeaseDestroyed{})
	if c := step(MsgDestroy{}); len(c) != 0 {
		t.Errorf("destroying a destroyed node: %v, want nothing", c)
	}
}

func TestUninstallUndoesNewestFirstAndOnlyWhatWasRecorded(t *testing.T) {
	c := newFakeClient()
	items := []Installed{
		{Kind: InstalledParent, Path: "/etc/sysusers.d"},
		{Kind: InstalledDir, Path: "/var/lib/infermesh"},
		{Kind: InstalledFile, Path: "/usr/local/bin/infermeshd"},
		{Kind: InstalledFile, Path: "/etc/systemd/system/infermeshd.service"},
		{Kind: InstalledUnit, Path: "infermeshd.service"},
	}
	if err := Uninstall(t.Context(), c, "root", items, nil); err != nil {
		t.Fatal(err)
	}
	got := c.ran()
	want := []string{
		"systemctl disable --now 'infermeshd.service'",
		"rm -f '/etc/systemd/system/infermeshd.service'",
		"rm -f '/usr/local/bin/infermeshd'",
		"rm -rf --one-file-system '/var/lib/infermesh'",
		"rmdir --ignore-fail-on-non-empty '/etc/sysusers.d'",
		"systemctl daemon-reload",
	}
	if len(got) != len(want) {
		t.Fatalf("ran %d commands:\n%s\nwant %d", len(got), strings.Join(got, "\n"), len(want))
	}
	for i := range want {
		if !strings.Contains(got[i], want[i]) {
			t.Errorf("command %d = %q, want it to contain %q", i, got[i], want[i])
		}
	}
	// Paths that could remove more than what was put there are refused.
	for _, bad := range []string{"/", "relative/path", "/etc/../"} {
		if err := Uninstall(t.Context(), newFakeClient(), "root", []Installed{{Kind: InstalledDir, Path: bad}}, nil); err == nil {
			t.Errorf("Uninstall of dir %q succeeded", bad)
		}
	}
}

func TestFreshChecksCoverTopLevelPaths(t *testing.T) {
	in := testInstall()
	in.Uploads = []Upload{{Path: "/usr/local/bin/infermeshd"}}
	got := in.TopLevel()
	want := "/etc/sysusers.d/infermesh.conf /var/lib/infermesh /etc/infermesh /usr/local/bin/infermeshd /etc/systemd/system/infermeshd.service"
	if strings.Join(got, " ") != want {
		t.Errorf("TopLevel = %v, want %s", got, want)
	}
	if n := len(in.FreshChecks()); n != 5 {
		t.Errorf("%d fresh checks, want 5", n)
	}
}
