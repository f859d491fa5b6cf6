package node

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// fakeMembership answers from fixed state, changeable under its lock.
type fakeMembership struct {
	mu      sync.Mutex
	members map[string]MemberState
	adverts map[string]bool // node/role
	polls   int             // Member calls: one per poll of the manager
}

func (f *fakeMembership) Member(name string) (MemberState, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.polls++
	m, ok := f.members[name]
	return m, ok
}

func (f *fakeMembership) Advertises(node, role string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.adverts[node+"/"+role]
}

func (f *fakeMembership) set(name string, m MemberState, roles ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.members[name] = m
	for _, r := range roles {
		f.adverts[name+"/"+r] = true
	}
}

func newTestManager(t *testing.T, join time.Duration) (*Manager, *fakeLease, *fakeClient, *memIntents, *fakeMembership) {
	t.Helper()
	lease, client, intents := &fakeLease{kind: KindDocker}, newFakeClient(), newMemIntents()
	mem := &fakeMembership{members: map[string]MemberState{}, adverts: map[string]bool{}}
	m, err := NewManager(ManagerConfig{
		Intents: intents, Leases: []Lease{lease}, Clients: fakeFactory{client}, Membership: mem,
		JoinTimeout: join, PollInterval: 10 * time.Millisecond, LogDir: t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m, lease, client, intents, mem
}

// TestManagerConvergesOnlyOnTheRightKeyAndAdverts: admitted with another
// key, or without the consumed role's advert, is not joined; the key read
// back from the host and the advert are.
func TestManagerConvergesOnlyOnTheRightKeyAndAdverts(t *testing.T) {
	m, _, _, intents, mem := newTestManager(t, time.Minute)
	var progress []Progress
	var mu sync.Mutex
	done := make(chan error, 1)
	go func() {
		_, err := m.Add(context.Background(), testSpec(KindDocker), fixed(testInstall()), func(p Progress) {
			mu.Lock()
			progress = append(progress, p)
			mu.Unlock()
		})
		done <- err
	}()
	waitRecord := func(phase Phase) {
		t.Helper()
		testproc.WaitUntil(t, "the node to reach "+string(phase), 30*time.Second, func() bool {
			r, ok := intents.get("gpu-7")
			return ok && r.Phase == phase
		})
	}
	// pollsPast waits until the manager has made two whole polls since
	// now (a third has begun), so a phase checked after it was decided on
	// what was set before.
	pollsPast := func() {
		t.Helper()
		polls := func() int { mem.mu.Lock(); defer mem.mu.Unlock(); return mem.polls }
		from := polls()
		testproc.WaitUntil(t, "three membership polls", 30*time.Second, func() bool { return polls() >= from+3 })
	}
	waitRecord(PhaseWaitingForJoin)
	mem.set("gpu-7", MemberState{PublicKey: "someone else's key", Admitted: true}, "chat")
	pollsPast() // none may count this as joined
	if r, _ := intents.get("gpu-7"); r.Phase != PhaseWaitingForJoin {
		t.Fatalf("phase %s with the wrong key, want waiting_for_join", r.Phase)
	}
	mem.mu.Lock()
	mem.adverts = map[string]bool{}
	mem.mu.Unlock()
	mem.set("gpu-7", MemberState{PublicKey: fakeNodeKey, Admitted: true})
	pollsPast()
	if r, _ := intents.get("gpu-7"); r.Phase != PhaseWaitingForJoin {
		t.Fatalf("phase %s without the chat advert, want waiting_for_join", r.Phase)
	}
	mem.set("gpu-7", MemberState{PublicKey: fakeNodeKey, Admitted: true}, "chat")
	if err := <-done; err != nil {
		t.Fatalf("Add: %v", err)
	}
	if r, _ := intents.get("gpu-7"); r.Phase != PhaseConverged {
		t.Errorf("record phase %s, want converged", r.Phase)
	}
	mu.Lock()
	last := progress[len(progress)-1]
	mu.Unlock()
	if last.Kind != ProgressDone || !strings.Contains(last.Message, fakeNodeKey) {
		t.Errorf("last progress = %+v, want done with the node's key", last)
	}
	// A second add of the name is refused; so is one while it runs.
	if _, err := m.Add(context.Background(), testSpec(KindDocker), fixed(testInstall()), nil); !errors.Is(err, ErrExists) {
		t.Errorf("second Add = %v, want ErrExists", err)
	}
}

// TestManagerJoinDeadline: a node that never joins fails at
// waiting_for_join, saying what was missing, and is torn down.
func TestManagerJoinDeadline(t *testing.T) {
	m, lease, client, intents, mem := newTestManager(t, 300*time.Millisecond)
	mem.set("gpu-7", MemberState{PublicKey: fakeNodeKey, Admitted: false, Why: "certificate expired"})
	_, err := m.Add(context.Background(), testSpec(KindDocker), fixed(testInstall()), nil)
	var ne *Error
	if !errors.As(err, &ne) || !errors.Is(err, ErrBootstrap) || ne.Stage != StageWaitingForJoin ||
		!strings.Contains(ne.Reason, "never joined within") || !strings.Contains(ne.Reason, "certificate expired") {
		t.Fatalf("Add = %v, want ErrBootstrap at waiting_for_join saying why", err)
	}
	if len(lease.destroyCalls()) != 1 || !client.closed.Load() {
		t.Errorf("destroys %d, client closed %v; want the teardown", len(lease.destroyCalls()), client.closed.Load())
	}
	if _, ok := intents.get("gpu-7"); ok {
		t.Error("the intent outlived the teardown")
	}
}

// TestManagerCloseTearsDownAddsInFlight: closing the manager (the agent
// stopping) ends an add waiting for its join with a teardown.
func TestManagerCloseTearsDownAddsInFlight(t *testing.T) {
	m, lease, _, intents, _ := newTestManager(t, time.Minute)
	done := make(chan error, 1)
	go func() {
		_, err := m.Add(context.Background(), testSpec(KindDocker), fixed(testInstall()), nil)
		done <- err
	}()
	testproc.WaitUntil(t, "the add to wait for its join", 30*time.Second, func() bool {
		r, ok := intents.get("gpu-7")
		return ok && r.Phase == PhaseWaitingForJoin
	})
	m.Close()
	if err := <-done; !errors.Is(err, ErrBootstrap) {
		t.Errorf("Add after Close = %v, want the cancelled bootstrap", err)
	}
	if len(lease.destroyCalls()) != 1 {
		t.Error("the add in flight was not torn down")
	}
}

// TestManagerRecover: at start, nodes whose add did not finish are torn
// down (a lease being created is found by name); converged nodes stay.
func TestManagerRecover(t *testing.T) {
	m, lease, _, intents, _ := newTestManager(t, time.Minute)
	spec := func(name string) Spec {
		s := testSpec(KindDocker)
		s.Name = name
		return s
	}
	facts := &LeaseFacts{Provider: KindDocker, ID: "docker:c9", ContractID: "c9"}
	for _, r := range []Record{
		{Spec: spec("leasing"), Phase: PhaseLeasing},
		{Spec: spec("half"), Phase: PhaseBootstrapping, Stage: StageAgentStarting, Lease: facts, SessionOpen: true},
		{Spec: spec("stuck"), Phase: PhaseDestroying, Lease: facts},
		{Spec: spec("done"), Phase: PhaseConverged, Lease: facts},
	} {
		if err := intents.Put(r); err != nil {
			t.Fatal(err)
		}
	}
	gone, err := m.Recover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(gone, ",") != "half,leasing,stuck" {
		t.Errorf("torn down %v, want half, leasing, stuck", gone)
	}
	left, _ := m.List()
	if len(left) != 1 || left[0].Spec.Name != "done" {
		t.Errorf("left %+v, want only the converged node", left)
	}
	var byName []string
	for _, d := range lease.destroyCalls() {
		if d.LeaseID == "" {
			byName = append(byName, d.Node)
		}
	}
	if strings.Join(byName, ",") != "leasing" {
		t.Errorf("destroyed by name %v, want the node whose lease was being created", byName)
	}
	if _, err := m.Remove(context.Background(), "nobody", nil); !errors.Is(err, ErrUnknown) {
		t.Errorf("Remove(nobody) = %v, want ErrUnknown", err)
	}
}
