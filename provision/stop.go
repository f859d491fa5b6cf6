package provision

import (
	"context"
	"fmt"

	"go.uber.org/zap"
)

// Stopping instances on purpose. Instances outlive the agent by design
// (the next agent adopts them without a gap); these are the two ways to
// stop one anyway: the operator's (Stop, `infermesh instances stop`) and
// the agent's at shutdown for roles configured so (Halt).

// StoppedByOperator is the LastError of an instance Stop stopped.
const StoppedByOperator = "stopped by the operator; `infermesh instances retry ROLE` starts it again"

// Stop stops role's instance and keeps it stopped: its supervisor ends,
// its resource is stopped and forgotten, and the role shows StateStopped
// (StoppedByOperator) until Retry, a changed spec or an agent restart. It
// returns when the resource is stopped or ctx ends.
func (m *Manager) Stop(ctx context.Context, role string) error {
	m.mu.Lock()
	in, err := m.supervisedLocked(role)
	if err != nil {
		m.mu.Unlock()
		return err
	}
	// A placeholder holds the role while (and after) it stops, so
	// reconcile leaves it alone: it has the desired spec.
	ph := m.newInstance(role, in.spec, 0)
	ph.restarts = in.restartsTotal()
	ph.st.Image = in.status().Image // what was stopped, for the operator
	ph.cancel = func() {}
	close(ph.done)
	ph.setState(StateRemoving, "stopping on the operator's request")
	m.setInstanceLocked(role, ph)
	m.mu.Unlock()

	in.stop() // the supervisor ends; the resource is left for halt
	if err := m.halt(ctx, ph); err != nil {
		ph.setState(StateFailed, "stopping: "+err.Error())
		return err
	}
	ph.setState(StateStopped, StoppedByOperator)
	ph.emit(EventInstanceStopped, "stopped by the operator")
	m.log.Info("instance stopped by the operator", zap.String("role", role))
	return nil
}

// Halt stops and forgets every attempt of each role's instance, as at a
// shutdown that must not leave them running. Call it after Run returned:
// no supervisor may restart them meanwhile.
func (m *Manager) Halt(ctx context.Context, roles ...string) error {
	var first error
	for _, role := range roles {
		if err := m.halt(ctx, m.newInstance(role, InstanceSpec{}, 0)); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (m *Manager) halt(ctx context.Context, in *instance) error {
	m.cfg.Registrar.DeregisterLocal(in.role)
	if !in.stopRole(ctx, "") {
		return fmt.Errorf("role %q: stopping its instance: %w", in.role, ctx.Err())
	}
	return nil
}
