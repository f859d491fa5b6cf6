//go:build e2e

package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"text/tabwriter"
	"time"
)

// record is one request of cmd/e2eload.
type record struct {
	Stream bool   `json:"stream"`
	Start  int64  `json:"start"`
	First  int64  `json:"first"`
	End    int64  `json:"end"`
	Result string `json:"result"`
	Err    string `json:"err"`
}

// stalledAfter: a request that took longer is stalled (a normal one takes
// at most ~1.5 s: 64 tokens at 20 ms).
const stalledAfter = 5 * time.Second

// load is one run of the load generator on h0.
type load struct {
	c    *cluster
	name string
}

func (c *cluster) startLoad(name string) *load {
	c.t.Helper()
	l := &load{c: c, name: name}
	h0 := c.hosts[0]
	if out, code := c.exec(h0, "rm", "-f", l.file(), l.stopFile()); code != 0 {
		c.t.Fatal(out)
	}
	if _, err := docker(c.t.Context(), "exec", "-d", h0.ctr, "/usr/local/bin/e2eload",
		"-duration", "10m", "-workers", "6", "-stop-file", l.stopFile(), "-out", l.file()); err != nil {
		c.t.Fatal(err)
	}
	return l
}

func (l *load) file() string     { return "/tmp/e2eload-" + l.name + ".jsonl" }
func (l *load) stopFile() string { return "/tmp/e2eload-" + l.name + ".stop" }

// stop tells the generator to stop, waits for its requests to end and
// returns them.
func (l *load) stop() []record {
	c := l.c
	c.t.Helper()
	h0 := c.hosts[0]
	c.exec(h0, "touch", l.stopFile())
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if _, code := c.exec(h0, "test", "-e", l.file()); code == 0 {
			break
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("load %s: no output after its stop", l.name)
		}
		time.Sleep(200 * time.Millisecond)
	}
	out, code := c.exec(h0, "cat", l.file())
	if code != 0 {
		c.t.Fatal(out)
	}
	var rs []record
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			c.t.Fatalf("load %s: %v: %q", l.name, err, sc.Text())
		}
		rs = append(rs, r)
	}
	return rs
}

// outcome is one fault's row of the table.
type outcome struct {
	fault         string
	sent, failed  int
	stalled       int
	aborted       int           // streams cut with a clear error
	cleanCut      int           // streams cut yet ended as if complete: never acceptable
	lostAfter     int           // failed or cut requests that started after the fault was over
	maxAfter      time.Duration // the longest request that started after the fault
	maxTTFB       time.Duration // the longest wait for a first byte (or the failure) after the fault
	failover      time.Duration // from the fault to the last failed or stalled request's start
	whole         time.Duration // from the end of the fault to a whole mesh
	firstFailure  string
	faultAt, over time.Time
}

func analyze(fault string, rs []record, faultAt, over, wholeAt time.Time) outcome {
	o := outcome{fault: fault, sent: len(rs), faultAt: faultAt, over: over}
	if !wholeAt.IsZero() {
		o.whole = wholeAt.Sub(over)
	}
	var lastBad time.Time
	for _, r := range rs {
		start, end := time.Unix(0, r.Start), time.Unix(0, r.End)
		bad := false
		switch r.Result {
		case "failed":
			o.failed++
			bad = true
		case "aborted":
			o.aborted++
			bad = true
		case "clean_cut":
			o.cleanCut++
			bad = true
		}
		if end.Sub(start) > stalledAfter {
			o.stalled++
			bad = true
		}
		if bad && o.firstFailure == "" && r.Err != "" {
			o.firstFailure = r.Result + ": " + r.Err
		}
		if bad && !start.Before(faultAt) && start.After(lastBad) {
			lastBad = start
		}
		if bad && start.After(over) {
			o.lostAfter++
		}
		if !start.Before(faultAt) {
			o.maxAfter = max(o.maxAfter, end.Sub(start))
			first := end
			if r.First != 0 {
				first = time.Unix(0, r.First)
			}
			o.maxTTFB = max(o.maxTTFB, first.Sub(start))
		}
	}
	if !lastBad.IsZero() {
		o.failover = lastBad.Sub(faultAt)
	}
	return o
}

var codeRE = regexp.MustCompile(`"code":"([^"]+)"`)

// failuresByError counts failed requests by kind: connection refused, or
// the status and error code of the answer.
func failuresByError(rs []record) map[string]int {
	out := map[string]int{}
	for _, r := range rs {
		if r.Result != "failed" {
			continue
		}
		e := r.Err
		switch m := codeRE.FindStringSubmatch(e); {
		case strings.Contains(e, "connection refused"):
			e = "connection refused"
		case m != nil:
			e = strings.SplitN(e, ":", 2)[0] + " " + m[1]
		case len(e) > 80:
			e = e[:80]
		}
		out[e]++
	}
	return out
}

func printTable(t *testing.T, rows []outcome) {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "fault\tsent\tfailed\tstalled\tcut, clear abort\tcut, clean end (lie)\tlost after the fault\tmax first byte\tmax request\tbad window\tmesh whole")
	for _, o := range rows {
		whole := "-"
		if o.whole > 0 {
			whole = o.whole.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%v\t%v\t%v\t%s\n", o.fault, o.sent, o.failed, o.stalled, o.aborted, o.cleanCut,
			o.lostAfter, o.maxTTFB.Round(time.Millisecond), o.maxAfter.Round(time.Millisecond), o.failover.Round(time.Millisecond), whole)
	}
	fmt.Fprintln(tw, "(max first byte, max request: over requests started after the fault began; bad window: from the fault to the start of the last failed or stalled request; mesh whole: from the heal (restart done, docker start, unpause, reconnect; for the agent crash, from the kill))")
	tw.Flush()
	t.Log("\n" + b.String())
	if p := os.Getenv("E2E_TABLE"); p != "" {
		_ = os.WriteFile(p, []byte(b.String()), 0o644)
	}
}

// TestClusterFaults is `make e2e`: N systemd hosts (E2E_HOSTS, default 5),
// one fault after the other under load, each healed before the next.
func TestClusterFaults(t *testing.T) {
	c := newCluster(t, envInt("E2E_HOSTS", 5))
	all := c.hosts
	srv := c.servers()
	var rows []outcome
	defer func() { printTable(t, rows) }()
	settle := func() { time.Sleep(3 * time.Second) } // load before and after each fault
	check := func(o outcome) {
		rows = append(rows, o)
		if o.cleanCut > 0 {
			t.Errorf("%s: %d streams ended as if complete without [DONE]", o.fault, o.cleanCut)
		}
		if o.lostAfter > 0 {
			t.Errorf("%s: %d requests that started after the fault was over failed (first: %s)", o.fault, o.lostAfter, o.firstFailure)
		}
	}

	// 1. A rolling restart of every serving host, one at a time, then of
	// the application host's own agent (the one the load goes through:
	// its port's socket is kept by systemd while the old agent drains and
	// the new one starts, so the app's requests wait instead of failing;
	// "over" is when systemctl restart returns, i.e. the new agent's
	// READY).
	{
		l := c.startLoad("rolling")
		settle()
		at := time.Now()
		for _, h := range srv {
			c.restart(h)
		}
		settle()
		o := analyze("rolling restart of the serving hosts", l.stop(), at, at, time.Time{})
		check(o)
		if o.failed > 0 || o.aborted > 0 || o.stalled > 0 {
			t.Errorf("rolling restart: %d failed, %d cut, %d stalled; want none (first: %s)\n%s", o.failed, o.aborted, o.stalled, o.firstFailure, c.refusals())
		}
	}
	{
		l := c.startLoad("restart-h0")
		settle()
		at := time.Now()
		c.restartAgent(c.hosts[0]) // returns once the new agent reported READY
		ready := time.Now()
		if _, err := c.waitWhole(c.hosts, 2*time.Minute); err != nil {
			t.Fatalf("after restarting %s: %v", c.hosts[0].name, err)
		}
		settle()
		rs := l.stop()
		o := analyze("restart of the application host's agent (over: READY)", rs, at, ready, time.Time{})
		t.Logf("restart of h0: systemctl restart took %v", ready.Sub(at).Round(time.Millisecond))
		check(o)
		if o.aborted > 0 {
			t.Errorf("restart of h0: %d streams cut; want every stream drained", o.aborted)
		}
		// The role port's socket is kept in systemd's store across the
		// restart and the new agent accepts once it has joined: the app's
		// requests wait, none fails.
		if o.failed > 0 {
			t.Errorf("restart of h0: %d requests failed, by error: %v; want none\n%s", o.failed, failuresByError(rs), c.refusals())
		}
	}

	// 2. An agent crash with its instance still up: adopted on restart.
	{
		h := srv[0]
		pid := func() string { out, _ := c.exec(h, "pgrep", "-f", "infermesh-demo"); return out }
		before := pid()
		l := c.startLoad("agent-kill")
		settle()
		at := time.Now()
		if out, code := c.exec(h, "systemctl", "kill", "--kill-whom=main", "-s", "SIGKILL", "infermeshd"); code != 0 {
			t.Fatalf("%s: systemctl kill: %s", h.name, out)
		}
		over := at.Add(time.Second)
		wholeAt, err := c.waitWhole(all, 2*time.Minute)
		if err != nil {
			t.Errorf("after the agent crash on %s: %v", h.name, err)
		}
		settle()
		o := analyze("agent SIGKILL, instance up ("+h.name+")", l.stop(), at, over, wholeAt)
		o.whole = wholeAt.Sub(at)
		check(o)
		if after := pid(); before == "" || after != before {
			t.Errorf("%s: the instance's pid was %q before the crash, %q after: want it adopted", h.name, before, after)
		}
	}

	// 3. Power loss: docker kill; then the host boots again.
	{
		h := srv[1]
		l := c.startLoad("kill")
		settle()
		at := time.Now()
		if _, err := docker(t.Context(), "kill", h.ctr); err != nil {
			t.Fatal(err)
		}
		over := at.Add(time.Second) // the failover budget
		settle()
		bootAt := time.Now()
		if _, err := docker(t.Context(), "start", h.ctr); err != nil {
			t.Fatal(err)
		}
		wholeAt, err := c.waitWhole(all, 3*time.Minute)
		if err != nil {
			t.Errorf("after %s booted again: %v", h.name, err)
		}
		settle()
		o := analyze("host killed (docker kill "+h.name+"), booted 3s later", l.stop(), at, over, wholeAt)
		o.whole = wholeAt.Sub(bootAt)
		check(o)
		if o.maxTTFB > time.Second {
			t.Errorf("docker kill: a request waited %v for its first byte after the kill, want failover within 1s", o.maxTTFB)
		}
	}

	// 4. A hung host: docker pause for 10 s.
	{
		h := srv[2]
		l := c.startLoad("pause")
		settle()
		if _, err := docker(t.Context(), "pause", h.ctr); err != nil {
			t.Fatal(err)
		}
		// The host is frozen once docker pause returns: a stream that got
		// its first bytes from it before then is cut mid-way by the freeze
		// (it ends with an abort after the QUIC idle timeout); requests
		// started from now on must not wait for that timeout.
		at := time.Now()
		time.Sleep(10 * time.Second)
		if _, err := docker(t.Context(), "unpause", h.ctr); err != nil {
			t.Fatal(err)
		}
		over := time.Now()
		wholeAt, err := c.waitWhole(all, 2*time.Minute)
		if err != nil {
			t.Errorf("after unpausing %s: %v", h.name, err)
		}
		settle()
		o := analyze("host frozen 10s (docker pause "+h.name+")", l.stop(), at, over, wholeAt)
		check(o)
		if o.maxAfter >= 6*time.Second {
			t.Errorf("docker pause: a request took %v, want none stuck for the 6s QUIC idle timeout", o.maxAfter)
		}
	}

	// 5. A partition: 30 s off the network, then back.
	{
		h := srv[3%len(srv)]
		l := c.startLoad("partition")
		settle()
		at := time.Now()
		if _, err := docker(t.Context(), "network", "disconnect", c.net, h.ctr); err != nil {
			t.Fatal(err)
		}
		time.Sleep(30 * time.Second)
		if _, err := docker(t.Context(), "network", "connect", "--ip", h.ip, c.net, h.ctr); err != nil {
			t.Fatal(err)
		}
		over := time.Now()
		wholeAt, err := c.waitWhole(all, 2*time.Minute)
		if err != nil {
			t.Errorf("after the partition of %s healed: %v", h.name, err)
		}
		settle()
		o := analyze("partition 30s (network disconnect "+h.name+")", l.stop(), at, over, wholeAt)
		check(o)
		if o.maxTTFB > time.Second {
			t.Errorf("partition: a request waited %v for its first byte after it began, want failover within 1s", o.maxTTFB)
		}
	}
}

// restart restarts h's agent (systemctl restart: a rolling upgrade's step)
// and waits until the mesh is whole again.
func (c *cluster) restart(h *host) {
	c.t.Helper()
	c.restartAgent(h)
	if _, err := c.waitWhole(c.hosts, 2*time.Minute); err != nil {
		c.t.Fatalf("after restarting %s: %v", h.name, err)
	}
}

// restartAgent runs systemctl restart infermeshd on h: it returns once the
// new agent reported READY (Type=notify).
func (c *cluster) restartAgent(h *host) {
	c.t.Helper()
	if out, code := c.exec(h, "systemctl", "restart", "infermeshd"); code != 0 {
		c.t.Fatalf("%s: systemctl restart: %s\n%s", h.name, out, c.journal(h))
	}
}

// refusals are the serving hosts' recent refusals of peers, from their
// logs: why a request was refused.
func (c *cluster) refusals() string {
	var b strings.Builder
	for _, h := range c.servers() {
		out, _ := c.exec(h, "sh", "-c", "journalctl -u infermeshd --no-pager -o cat | grep -E 'infer.peer.refused|mesh.quic.refused' | tail -n 3")
		if out != "" {
			fmt.Fprintf(&b, "%s:\n%s\n", h.name, out)
		}
	}
	return b.String()
}
