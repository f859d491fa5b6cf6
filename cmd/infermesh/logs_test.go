package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/agent/admin/admintest"
	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// TestInstanceLogsFollowRealAgent: `instances logs chat -f` against a
// real agent and its native instance (the demo model, logging each request
// at debug level) prints the recent lines, then a line the instance writes
// after the follow began; interrupted, it exits 0 (and leaves no goroutine:
// the package's leak check).
func TestInstanceLogsFollowRealAgent(t *testing.T) {
	bins := staticBins(t)
	port := testnet.TCPPort(t, "127.0.0.1")
	e := newSiteEnv(t, t.TempDir(), "logs", fmt.Sprintf(
		"  chat: {port: %d, model: m, instance: {runtime: native, command: %s, args: [-listen, 127.0.0.1:%d, -model, m, -log-level, debug], port: %d, stop_with_agent: true}}\n",
		testnet.TCPPort(t, "127.0.0.1"), bins["infermesh-demo"], port, port))
	_, stop := startRealAgent(t, e.config)
	defer stop()
	if out, errOut, code := runCLI(t, "route", "chat", "--serving", "--wait", "60s", "--socket", e.socket); code != 0 {
		t.Fatalf("chat never served: exit %d\n%s%s", code, out, errOut)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	var errOut strings.Builder
	codec := make(chan int, 1)
	go func() {
		code := runContext(ctx, []string{"instances", "logs", "chat", "-f", "-n", "5", "--socket", e.socket}, pw, &errOut)
		pw.Close()
		codec <- code
	}()
	lines := make(chan string, 256)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	await := func(what, want string) {
		t.Helper()
		deadline := time.After(60 * time.Second)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("the follow ended before %s: %s", what, errOut.String())
				}
				if strings.Contains(l, want) {
					return
				}
			case <-deadline:
				t.Fatalf("no line with %q (%s) within 60s", want, what)
			}
		}
	}
	await("the recent lines", "ready")
	resp, err := http.Post("http://127.0.0.1:"+strconv.Itoa(port)+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"follow me"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	await("the line of a request made after the follow began", `"generate"`)

	cancel()
	select {
	case code := <-codec:
		if code != 0 {
			t.Errorf("instances logs -f interrupted = exit %d (%s), want 0", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("instances logs -f did not end after the interrupt")
	}
	for range lines {
	}
}

// TestInstanceLogsFollowEnds: the follow ends, exit 0, saying why, when
// the role's instance goes away; a role without one is an error at once.
func TestInstanceLogsFollowEnds(t *testing.T) {
	fake := admintest.New()
	fake.LogLines = make(chan admin.LogLine)
	sock := fakeAgent(t, fake)
	pr, pw := io.Pipe()
	var errOut strings.Builder
	codec := make(chan int, 1)
	go func() {
		code := runContext(context.Background(), []string{"instances", "logs", "embed", "-f", "--json", "--socket", sock}, pw, &errOut)
		pw.Close()
		codec <- code
	}()
	sc := bufio.NewScanner(pr)
	for i := 0; i < 2 && sc.Scan(); i++ { // the recent lines
	}
	fake.LogLines <- admin.LogLine{Time: admintest.T0, Stream: "stdout", Line: "a new line"}
	if !sc.Scan() || !strings.Contains(sc.Text(), `"line":"a new line"`) {
		t.Fatalf("after a new line the follow printed %q, want it as a JSON line", sc.Text())
	}
	close(fake.LogLines)
	for sc.Scan() {
		t.Errorf("after the end: %q", sc.Text())
	}
	if code := <-codec; code != 0 || errOut.String() != "infermesh: the log ended: role \"embed\" has no managed instance any more\n" {
		t.Errorf("follow of an instance that went away = exit %d, %q; want 0 and why", code, errOut.String())
	}
	if _, errOut, code := runCLI(t, "instances", "logs", "nope", "-f", "--socket", sock); code != exitFailure || !strings.Contains(errOut, `no managed instance for role "nope"`) {
		t.Errorf("follow of a role without an instance = exit %d, %q; want 1 and not found", code, errOut)
	}
}
