package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

// Two scrapes 2s apart: the rates, the errors, the share each target
// served and the TTFT quantiles of the streams started in between.
func TestTopRowsFromTwoScrapes(t *testing.T) {
	const before = `
# TYPE infermesh_time_to_first_token_seconds histogram
infermesh_requests_total{role="chat",target="local",source="app",code="200"} 10
infermesh_requests_total{role="chat",target="b",source="app",code="200"} 4
infermesh_requests_total{role="chat",target="none",source="app",code="503"} 1
infermesh_requests_total{role="chat",target="local",source="peer",code="200"} 7
infermesh_tokens_total{role="chat",target="local",source="app",kind="completion"} 100
infermesh_tokens_total{role="chat",target="local",source="app",kind="prompt"} 999
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="0.1"} 5
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="0.2"} 5
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="+Inf"} 5
infermesh_time_to_first_token_seconds_sum{role="chat",target="local",source="app"} 0.3
infermesh_time_to_first_token_seconds_count{role="chat",target="local",source="app"} 5
infermesh_active_streams{role="chat"} 0
`
	const after = `
# TYPE infermesh_time_to_first_token_seconds histogram
infermesh_requests_total{role="chat",target="local",source="app",code="200"} 16
infermesh_requests_total{role="chat",target="b",source="app",code="200"} 6
infermesh_requests_total{role="chat",target="none",source="app",code="503"} 3
infermesh_requests_total{role="chat",target="local",source="peer",code="200"} 11
infermesh_requests_total{role="embed",target="local",source="app",code="200"} 2
infermesh_tokens_total{role="chat",target="local",source="app",kind="completion"} 180
infermesh_tokens_total{role="chat",target="local",source="app",kind="prompt"} 2000
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="0.1"} 7
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="0.2"} 15
infermesh_time_to_first_token_seconds_bucket{role="chat",target="local",source="app",le="+Inf"} 15
infermesh_time_to_first_token_seconds_sum{role="chat",target="local",source="app"} 1.9
infermesh_time_to_first_token_seconds_count{role="chat",target="local",source="app"} 15
infermesh_active_streams{role="chat"} 3
infermesh_instance_capacity{role="chat",kind="slots"} 4
infermesh_instance_capacity{role="chat",kind="running"} 4
infermesh_instance_capacity{role="chat",kind="waiting"} 2
infermesh_instance_kv_cache_usage_ratio{role="chat"} 0.5
`
	t0 := time.Unix(1000, 0)
	prev, err := parseTopSample(before, t0)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := parseTopSample(after, t0.Add(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	rows := topRows(prev, cur)
	if len(rows) != 2 || rows[0].Role != "chat" || rows[1].Role != "embed" {
		t.Fatalf("rows = %+v, want chat and embed", rows)
	}
	r := rows[0]
	// 6 local + 2 b + 2 none in 2s.
	if r.ReqPerSec != 5 || r.ErrPerSec != 1 || r.TokensPerSec != 40 || r.PeerReqPerSec != 2 || r.Streams != 3 {
		t.Errorf("chat = %+v", r)
	}
	if !r.Local || r.Slots != 4 || r.Running != 4 || r.Waiting != 2 || r.KVUsage != 0.5 {
		t.Errorf("chat's local instance = %+v, want 4/4 slots, 2 queued, kv 0.5", r)
	}
	want := []topShare{{"local", 0.6}, {"b", 0.2}, {"none", 0.2}}
	if len(r.Share) != 3 {
		t.Fatalf("share = %+v, want %+v", r.Share, want)
	}
	for i, s := range want {
		if r.Share[i].Target != s.Target || math.Abs(r.Share[i].Fraction-s.Fraction) > 1e-9 {
			t.Errorf("share = %+v, want %+v", r.Share, want)
		}
	}
	// 10 streams started: 2 under 0.1s, 8 in (0.1, 0.2]. The median, rank
	// 5, is 3/8 into the second bucket; p90, rank 9, is 7/8 into it.
	if math.Abs(r.TTFTp50-0.1375) > 1e-9 || math.Abs(r.TTFTp90-0.1875) > 1e-9 {
		t.Errorf("TTFT p50, p90 = %v, %v; want 0.1375, 0.1875", r.TTFTp50, r.TTFTp90)
	}
	if e := rows[1]; e.ReqPerSec != 1 || !math.IsNaN(e.TTFTp50) || len(e.Share) != 1 || e.Share[0].Target != "local" {
		t.Errorf("embed = %+v, want 1 req/s all local, no TTFT", e)
	}
	// A counter that went back (the agent restarted) counts from zero.
	restarted, err := parseTopSample(before, t0.Add(4*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if rows := topRows(cur, restarted); rows[0].ReqPerSec != 7.5 {
		t.Errorf("after a restart, chat = %v req/s, want the new counts (15 in 2s)", rows[0].ReqPerSec)
	}
}

func TestBucketQuantile(t *testing.T) {
	inf := math.Inf(1)
	for _, tt := range []struct {
		q       float64
		buckets map[float64]float64
		want    float64
	}{
		{0.5, map[float64]float64{1: 0, inf: 0}, math.NaN()},
		{0.5, map[float64]float64{1: 4, inf: 4}, 0.5},     // from 0 in the first bucket
		{0.9, map[float64]float64{1: 4, 2: 4, inf: 8}, 2}, // in +Inf: the highest finite bound
		{1, map[float64]float64{1: 2, 2: 4, inf: 4}, 2},
	} {
		got := bucketQuantile(tt.q, tt.buckets)
		if !(got == tt.want || math.IsNaN(got) && math.IsNaN(tt.want)) {
			t.Errorf("bucketQuantile(%v, %v) = %v, want %v", tt.q, tt.buckets, got, tt.want)
		}
	}
}

// topAgent starts a real agent serving chat from the demo model (each
// token 5ms apart) and a client sending streamed chat requests to it until
// the test ends; it returns the agent's socket.
func topAgent(t *testing.T) string {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model, cfg.TokenDelay, cfg.Tokens = "m", 5*time.Millisecond, 8
	demo, err := demomodel.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: demo, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	dir := t.TempDir()
	port := testnet.TCPPort(t, "127.0.0.1")
	sock := filepath.Join(dir, "admin.sock")
	conf := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nroles:\n  chat: {port: %d, upstream: \"http://%s\", model: m}\n",
		filepath.Join(dir, "state"), sock, port, ln.Addr())
	path := filepath.Join(dir, "infermesh.yaml")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	startRealAgent(t, path)
	// The load starts once the instance is registered: requests before
	// would be answered 503 (nothing serves chat yet).
	if out, errOut, code := runCLI(t, "route", "chat", "--serving", "--wait", "60s", "--socket", sock); code != 0 {
		t.Fatalf("chat never served: exit %d\n%s%s", code, out, errOut)
	}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		hc := &http.Client{}
		defer hc.CloseIdleConnections()
		for ctx.Err() == nil {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", port),
				strings.NewReader(`{"model":"chat","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`))
			resp, err := hc.Do(req)
			if err != nil {
				continue
			}
			_, _ = discardBody(resp)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
	return sock
}

// TestTopOnceRealAgent: `top --once --json` against a real agent its
// apps are using shows chat's requests, tokens and TTFT, all served
// locally; the text frame shows the row.
func TestTopOnceRealAgent(t *testing.T) {
	sock := topAgent(t)
	type row struct {
		Role     string   `json:"role"`
		Reqs     float64  `json:"requests_per_second"`
		Errs     float64  `json:"errors_per_second"`
		TTFT     *float64 `json:"ttft_p50_seconds"`
		Tokens   float64  `json:"completion_tokens_per_second"`
		ServedBy []struct {
			Target   string  `json:"target"`
			Fraction float64 `json:"fraction"`
		} `json:"served_by"`
	}
	var f struct {
		Node  string `json:"node"`
		Roles []row  `json:"roles"`
	}
	testproc.WaitUntil(t, "top --once shows chat's traffic", 60*time.Second, func() bool {
		out, errOut, code := runCLI(t, "top", "--once", "--json", "--socket", sock)
		if code != 0 {
			t.Fatalf("top --once --json: exit %d: %s", code, errOut)
		}
		if err := json.Unmarshal([]byte(out), &f); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		return len(f.Roles) == 1 && f.Roles[0].Reqs > 0 && f.Roles[0].Tokens > 0 && f.Roles[0].TTFT != nil
	})
	r := f.Roles[0]
	if f.Node != "a" || r.Role != "chat" || r.Errs != 0 || len(r.ServedBy) != 1 || r.ServedBy[0].Target != "local" || r.ServedBy[0].Fraction != 1 {
		t.Errorf("frame = %+v, want chat, no errors, all local", f)
	}
	out, errOut, code := runCLI(t, "top", "--once", "--socket", sock)
	if code != 0 {
		t.Fatalf("top --once: exit %d: %s", code, errOut)
	}
	if !strings.Contains(out, "infermesh top: node a") || !strings.Contains(out, "TTFT P50") || !strings.Contains(out, "\nchat ") {
		t.Errorf("top --once printed:\n%s", out)
	}
}

// TestTopInTmux runs `infermesh top` in a real terminal (a tmux pane)
// against a real agent: the screen shows chat's row served locally within
// a few frames, and q quits (the pane's process exits 0) leaving the
// terminal out of the alternate screen.
func TestTopInTmux(t *testing.T) {
	tmux, err := exec.LookPath("tmux")
	if err != nil {
		t.Fatal("tmux is needed (.ci/run installs it): ", err)
	}
	cli := bins.Get(t)["infermesh"]
	sock := topAgent(t)
	tmuxDir := t.TempDir()
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(tmux, append([]string{"-S", filepath.Join(tmuxDir, "tmux.sock"), "-f", "/dev/null"}, args...)...)
		cmd.Env = append(os.Environ(), "TERM=xterm-256color")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("tmux %v: %v: %s", args, err, out)
		}
		return string(out)
	}
	// The pane runs top under sh, which writes top's exit status to a
	// file: tmux 3.3a marks a pane dead on its terminal's EOF and may
	// never fill in #{pane_dead_status} (seen in about one run of six).
	status := filepath.Join(tmuxDir, "status")
	script := `"$0" top --socket "$1"; echo $? > "$2.tmp" && mv "$2.tmp" "$2"`
	run("new-session", "-d", "-s", "top", "-x", "160", "-y", "40", "sh", "-c", script, cli, sock, status)
	t.Cleanup(func() {
		cmd := exec.Command(tmux, "-S", filepath.Join(tmuxDir, "tmux.sock"), "kill-server")
		_ = cmd.Run()
	})
	run("set-option", "-t", "top", "remain-on-exit", "on")
	var screen string
	testproc.WaitUntil(t, "the top screen shows chat served locally", 60*time.Second, func() bool {
		screen = run("capture-pane", "-p", "-t", "top")
		for _, l := range strings.Split(screen, "\n") {
			if f := strings.Fields(l); len(f) > 0 && f[0] == "chat" && strings.Contains(l, "local 100%") && f[1] != "0" {
				return true
			}
		}
		return false
	})
	t.Logf("screen:\n%s", screen)
	if !strings.Contains(screen, "infermesh top: node a") {
		t.Errorf("screen:\n%s", screen)
	}
	run("send-keys", "-t", "top", "q")
	var code []byte
	testproc.WaitUntil(t, "top to exit on q", 30*time.Second, func() bool {
		var err error
		code, err = os.ReadFile(status)
		return err == nil
	})
	if got := strings.TrimSpace(string(code)); got != "0" {
		t.Errorf("top exited with status %s on q, want 0; the pane:\n%s", got, run("capture-pane", "-p", "-t", "top"))
	}
	// Out of the alternate screen: the frame is gone from the pane.
	testproc.WaitUntil(t, "the pane back on the normal screen, without top's frame", 10*time.Second, func() bool {
		return !strings.Contains(run("capture-pane", "-p", "-t", "top"), "TTFT P50")
	})
}

// discardBody reads and closes resp's body.
func discardBody(resp *http.Response) (int64, error) {
	defer resp.Body.Close()
	return io.Copy(io.Discard, resp.Body)
}
