package admintest

import (
	"context"
	"fmt"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
)

var _ admin.NodeBackend = (*Fake)(nil)

// Nodes lists two nodes: gpu-7 (ssh, converged, admitted) and lab-3
// (docker, a failed add whose teardown is running).
func (f *Fake) Nodes(context.Context) (admin.NodeList, error) {
	return admin.NodeList{
		BootstrapKey: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIH+zhse3Pko4mlH8Aunh5qS+nF8db2UVRduaH7NzCWe1 infermesh-bootstrap@a",
		Nodes: []admin.Node{
			{Name: "gpu-7", Provider: "ssh", Phase: "converged", Stage: "converged", Lease: "ssh:root@10.0.0.7:22",
				Endpoint: "root@10.0.0.7:22", Key: "c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8=", Roles: []string{"chat"},
				Installed: 9, Member: "admitted", Run: 7, Created: T0, Updated: T0.Add(12 * time.Second), By: "uid 0 (root) pid 42"},
			{Name: "lab-3", Provider: "docker", Phase: "destroying", Stage: "boot_check_failed", Lease: "docker:0123456789ab",
				Endpoint: "root@172.17.0.2:22", Roles: []string{"chat", "embed"}, Member: "not a member",
				Failure: "boot check failed: systemd: the host does not run systemd (exit 1)", Busy: "remove",
				Run: 8, Created: T0, Updated: T0.Add(3 * time.Second), By: "uid 0 (root) pid 43"},
		},
	}, nil
}

// AddNode streams a fixed add: its stages and two log lines, then done;
// a node named "fail" fails its boot check instead.
func (f *Fake) AddNode(_ context.Context, by admin.Caller, req admin.NodeAdd, emit func(admin.NodeEvent) error) error {
	f.record(by, "node add %s %s", req.Name, req.Provider)
	if req.Name == "taken" {
		return admin.Errorf(admin.ErrConflict, "node exists: node taken is recorded (phase converged); `infermesh node remove taken` first")
	}
	ev := func(i int, kind, phase, stage, msg string) admin.NodeEvent {
		return admin.NodeEvent{Time: T0.Add(time.Duration(i) * time.Second), Node: req.Name, Run: 7, Kind: kind, Phase: phase, Stage: stage, Message: msg}
	}
	log := func(i int, seq uint64, stream, line string) admin.NodeEvent {
		e := ev(i, admin.NodeEventLog, "", "", "")
		e.Seq, e.Stream, e.Line = seq, stream, line
		return e
	}
	evs := []admin.NodeEvent{
		ev(0, admin.NodeEventStage, "leasing", "", "creating a "+req.Provider+" lease"),
		ev(1, admin.NodeEventStage, "bootstrapping", "created", "root@10.0.0.7:22"),
		ev(1, admin.NodeEventStage, "bootstrapping", "connecting", "root@10.0.0.7:22"),
		ev(2, admin.NodeEventStage, "bootstrapping", "ready", "root@10.0.0.7:22, host key verified"),
		ev(2, admin.NodeEventStage, "bootstrapping", "stdout_streaming", "3 log source(s)"),
		log(2, 1, "stdout", "Linux 6.1.0 x86_64"),
		log(2, 2, "stderr", "cron.service loaded failed failed"),
		ev(3, admin.NodeEventStage, "bootstrapping", "boot_checking", "9 check(s)"),
	}
	if req.Name == "fail" {
		evs = append(evs,
			ev(3, admin.NodeEventStage, "failed", "boot_check_failed", "boot check failed: systemd: the host does not run systemd (exit 1)"),
			ev(4, admin.NodeEventStage, "destroying", "boot_check_failed", "destroying the lease ssh:root@10.0.0.7:22"),
			ev(4, admin.NodeEventStage, "destroyed", "boot_check_failed", "lease destroyed"),
			ev(4, admin.NodeEventFailed, "destroyed", "boot_check_failed", "boot check failed: systemd: the host does not run systemd (exit 1)"),
		)
	} else {
		evs = append(evs,
			ev(4, admin.NodeEventStage, "bootstrapping", "agent_starting", "infermeshd.service"),
			ev(9, admin.NodeEventStage, "waiting_for_join", "waiting_for_join", "the agent runs on the node"),
			ev(10, admin.NodeEventStage, "converged", "converged", req.Name),
			ev(10, admin.NodeEventDone, "converged", "converged", fmt.Sprintf("joined as %s with key c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8=", req.Name)),
		)
	}
	for _, e := range evs {
		if err := emit(e); err != nil {
			return err
		}
	}
	return nil
}

// RemoveNode streams a fixed removal of gpu-7; other names are unknown.
func (f *Fake) RemoveNode(_ context.Context, by admin.Caller, name string, emit func(admin.NodeEvent) error) error {
	f.record(by, "node remove %s", name)
	if name != "gpu-7" {
		return admin.Errorf(admin.ErrNotFound, "no node %s is recorded on this agent", name)
	}
	for i, e := range []admin.NodeEvent{
		{Kind: admin.NodeEventStage, Phase: "destroying", Stage: "converged", Message: "destroying the lease ssh:root@10.0.0.7:22"},
		{Kind: admin.NodeEventStage, Phase: "destroyed", Stage: "converged", Message: "lease destroyed"},
		{Kind: admin.NodeEventDone, Phase: "destroyed", Message: "removed"},
	} {
		e.Time, e.Node, e.Run = T0.Add(time.Duration(i)*time.Second), name, 7
		if err := emit(e); err != nil {
			return err
		}
	}
	return nil
}
