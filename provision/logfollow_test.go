package provision

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testnet"
)

func TestLogRingSince(t *testing.T) {
	line := func(i int) LogLine { return LogLine{Stream: "stdout", Line: strconv.Itoa(i)} }
	texts := func(ls []LogLine) string {
		var b []string
		for _, l := range ls {
			b = append(b, l.Line)
		}
		return strings.Join(b, ",")
	}
	r := NewLogRing(3)
	lines, pos := r.Tail(10)
	if len(lines) != 0 || pos != 0 {
		t.Fatalf("Tail of an empty ring = %v, %d", lines, pos)
	}
	got, next, dropped, added := r.Since(pos)
	if got != nil || next != 0 || dropped != 0 || added == nil {
		t.Fatalf("Since(0) of an empty ring = %v, %d, %d, %v; want nothing and a channel", got, next, dropped, added)
	}
	r.Add(line(1))
	select {
	case <-added:
	default:
		t.Fatal("Add did not close the channel Since returned")
	}
	got, next, dropped, added = r.Since(pos)
	if texts(got) != "1" || next != 1 || dropped != 0 || added != nil {
		t.Errorf("Since(0) = %q, %d, %d; want 1, 1, 0", texts(got), next, dropped)
	}
	for i := 2; i <= 6; i++ {
		r.Add(line(i))
	}
	// Lines 2..6 came after position 1; the ring keeps 4..6.
	got, next, dropped, _ = r.Since(1)
	if texts(got) != "4,5,6" || next != 6 || dropped != 2 {
		t.Errorf("Since(1) after 6 lines in a ring of 3 = %q, %d, %d; want 4,5,6, 6, 2 dropped", texts(got), next, dropped)
	}
	if lines, pos := r.Tail(2); texts(lines) != "5,6" || pos != 6 {
		t.Errorf("Tail(2) = %q, %d; want 5,6 and 6", texts(lines), pos)
	}
	if got, _, _, added := r.Since(6); got != nil || added == nil {
		t.Errorf("Since(6) = %v, want nothing new and a channel", got)
	}
}

// TestManagerFollowLogs follows a real native instance's log (the demo
// model, logging every request at debug level): the recent lines, then a
// line written after the follow began; the instance replaced by a changed
// spec is followed on; the role removed ends the follow with
// ErrNoInstance; a cancelled follow returns nil. No goroutine outlives it
// (the package's leak check).
func TestManagerFollowLogs(t *testing.T) {
	e := newNativeEnv(t)
	nm := newNativeMgr(t, e, "")
	port := testnet.TCPPort(t, "127.0.0.1")
	spec := nativeInstanceSpec(t, port, "-log-level", "debug")
	nm.apply(map[string]InstanceSpec{"chat": spec})
	first := nm.waitInstance("chat", "ready", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lines := make(chan LogLine, 1024)
	done := make(chan error, 1)
	go func() {
		done <- nm.m.FollowLogs(ctx, "chat", 0, func(l LogLine) error {
			lines <- l
			return nil
		})
	}()
	// await reads the follow until a line has want in it.
	await := func(what, want string) {
		t.Helper()
		deadline := time.After(60 * time.Second)
		for {
			select {
			case l := <-lines:
				if strings.Contains(l.Line, want) {
					return
				}
			case err := <-done:
				t.Fatalf("the follow ended (%v) before %s", err, what)
			case <-deadline:
				t.Fatalf("no line with %q (%s) within 60s", want, what)
			}
		}
	}
	await("the recent lines", fmt.Sprintf("started process %d", first.PID))

	// A request after the follow began: the demo model logs it.
	resp, err := http.Post("http://127.0.0.1:"+strconv.Itoa(port)+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m-chat","messages":[{"role":"user","content":"follow me"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	await("the request's log line", `"generate"`)

	// A changed spec replaces the instance: its lines follow.
	respec := nativeInstanceSpec(t, port, "-log-level", "debug", "-tokens", "3")
	nm.apply(map[string]InstanceSpec{"chat": respec})
	second := nm.waitInstance("chat", "replaced", func(s InstanceStatus, ok bool) bool {
		return ok && s.State == StateReady && s.PID != first.PID
	})
	await("the successor's lines", fmt.Sprintf("started process %d", second.PID))

	// The role removed: once its instance is gone, the follow ends.
	nm.apply(map[string]InstanceSpec{})
	select {
	case err := <-done:
		if !errors.Is(err, ErrNoInstance) {
			t.Errorf("the follow of a removed role ended with %v, want ErrNoInstance", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the follow did not end when the role's instance went away")
	}

	// Cancelled: nil, at once.
	nm.apply(map[string]InstanceSpec{"chat": spec})
	nm.waitInstance("chat", "ready again", func(s InstanceStatus, ok bool) bool { return ok && s.State == StateReady })
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- nm.m.FollowLogs(ctx2, "chat", 1, func(LogLine) error { return nil }) }()
	cancel2()
	select {
	case err := <-done2:
		if err != nil {
			t.Errorf("a cancelled follow = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a cancelled follow did not return")
	}
	if err := nm.m.FollowLogs(context.Background(), "nope", 0, func(LogLine) error { return nil }); !errors.Is(err, ErrNoInstance) {
		t.Errorf("following a role without an instance = %v, want ErrNoInstance at once", err)
	}
}
