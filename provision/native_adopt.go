package provision

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
)

// Adoption and inventory of native instances by their workload records.

// lookupSpec reads spec's record and checks its evidence. ok is false when
// there is no record or it is of another content (hash); a record whose
// evidence is forged is an error.
func (p *NativeProvider) lookupSpec(spec ProvisionSpec) (ref string, rec WorkloadRecord, ev Evidence, ok bool, err error) {
	ref = p.ProviderRef(spec)
	rec, err = p.readOwned(ref)
	if errors.Is(err, fs.ErrNotExist) {
		return ref, rec, ev, false, nil
	}
	if err != nil {
		return ref, rec, ev, false, err
	}
	if rec.SpecHash != spec.Hash() {
		return ref, rec, ev, false, nil
	}
	if ev, err = rec.Check(); err != nil {
		return ref, rec, ev, false, fmt.Errorf("%s: %w", ref, err)
	}
	if ev.Liveness == Forged {
		return ref, rec, ev, false, fmt.Errorf("%s: %w: %s", ref, ErrNotOwned, ev.Why)
	}
	return ref, rec, ev, true, nil
}

// AdoptBySpec adopts spec's process if its record is ours, has spec's hash
// and its evidence holds: it is followed from its last LogTail lines. A
// process that is gone (or whose pid another process has now) is not
// adopted (ok false); a record whose evidence is forged is an error.
func (p *NativeProvider) AdoptBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	ref, rec, ev, ok, err := p.lookupSpec(spec)
	if err != nil || !ok || ev.Liveness != Alive {
		return AdoptedInstance{}, false, err
	}
	n := p.register(ref, spec, sink)
	n.mu.Lock()
	err = p.attachLocked(n, ref, rec, ev, true)
	n.mu.Unlock()
	if errors.Is(err, ErrNotFound) {
		return AdoptedInstance{}, false, nil // exited just now
	}
	if err != nil {
		return AdoptedInstance{}, false, err
	}
	p.emit(n.sink, spec, ref, ObsProvider, fmt.Sprintf("adopted running process %d", ev.Pid))
	h := p.handle(spec, ref, ev.Pid)
	return AdoptedInstance{Handle: h, Ref: ref, Running: true}, true, nil
}

// PrepareBySpec registers the handle of spec's record (ours, same hash, in
// any state) without starting anything. It never starts a process: ok is
// false when there is no record.
func (p *NativeProvider) PrepareBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (AdoptedInstance, bool, error) {
	ref, rec, ev, ok, err := p.lookupSpec(spec)
	if err != nil || !ok {
		return AdoptedInstance{}, false, err
	}
	n := p.register(ref, spec, sink)
	pid := 0
	if ev.Liveness == Alive {
		n.mu.Lock()
		if p.attachLocked(n, ref, rec, ev, true) == nil {
			pid = ev.Pid
		}
		n.mu.Unlock()
	}
	return AdoptedInstance{Handle: p.handle(spec, ref, pid), Ref: ref, Running: pid > 0}, true, nil
}

// StopBySpec stops spec's process group if its record is ours (whatever its
// hash) and removes the record and logs. It returns false when there is no
// record.
func (p *NativeProvider) StopBySpec(ctx context.Context, spec ProvisionSpec, sink Sink) (bool, error) {
	ref := p.ProviderRef(spec)
	if _, err := p.readOwned(ref); errors.Is(err, fs.ErrNotExist) {
		p.forget(ref)
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("stop %s: %w", ref, err)
	}
	if _, ok := p.instance(ref); !ok {
		p.register(ref, spec, sink)
	}
	if err := p.HaltInstance(ctx, InstanceHandle{Ref: ref}); err != nil {
		return false, err
	}
	p.forget(ref)
	if err := p.removeResidue(ref); err != nil {
		return false, err
	}
	if sink != nil {
		p.emit(sink, spec, ref, ObsProvider, "stopped process and removed its record "+ref)
	}
	return true, nil
}

// Status reports ref's process from its record and the live system
// (ErrNotFound without a record, ErrNotOwned for another site's or node's,
// or a record whose evidence is forged). Its endpoint is 127.0.0.1:<port>.
func (p *NativeProvider) Status(ctx context.Context, ref string) (ResourceStatus, error) {
	rec, err := p.readOwned(ref)
	if errors.Is(err, fs.ErrNotExist) {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, ErrNotFound)
	}
	if err != nil {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, err)
	}
	st := ResourceStatus{Endpoints: map[int]string{rec.Port: "127.0.0.1:" + strconv.Itoa(rec.Port)}, ExitCode: -1}
	if rec.ExitStatus != nil {
		st.ExitCode = *rec.ExitStatus
	}
	if n, ok := p.instance(ref); ok {
		n.mu.Lock()
		run := n.run
		n.mu.Unlock()
		if run != nil && !run.isExited() && !run.fd.exited(0) {
			st.Running, st.Pid, st.ID, st.StartedAt = true, run.pid, strconv.Itoa(run.pid), rec.Started
			return st, nil
		}
	}
	ev, err := rec.Check()
	if err != nil {
		return ResourceStatus{}, fmt.Errorf("status %s: %w", ref, err)
	}
	switch ev.Liveness {
	case Forged:
		return ResourceStatus{}, fmt.Errorf("status %s: %w: %s", ref, ErrNotOwned, ev.Why)
	case Alive:
		st.Running, st.Pid, st.ID, st.StartedAt = true, ev.Pid, strconv.Itoa(ev.Pid), rec.Started
	}
	return st, nil
}

// ListManagedRefs lists the refs of this node's records of this site.
func (p *NativeProvider) ListManagedRefs(ctx context.Context) ([]string, error) {
	recs, err := findRecords(p.cfg.Dir, true)
	if err != nil {
		return nil, err
	}
	var refs []string
	for _, r := range recs {
		if r.Err == nil && p.owned(r.Rec) {
			refs = append(refs, r.Rec.Ref)
		}
	}
	return refs, nil
}
