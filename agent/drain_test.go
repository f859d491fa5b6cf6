package agent

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/proxy"
)

// TestRemoteDrainOnStop: a node told to stop (SIGTERM cancels Run) while
// it serves a stream forwarded by a peer over QUIC finishes that stream,
// like one of its own clients' streams: the client sees every token and
// [DONE]. Meanwhile new requests go to the other node, and the drained
// node's graceful exit does not count as a failure in the peer's scores
// (no cool-down when it comes back).
func TestRemoteDrainOnStop(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	tm.shutdown = 60 * time.Second // the drain, not its deadline, ends the stream
	const tokens = 100
	ub := startUpstream(t, "model-b", 15*time.Millisecond)
	uc := startUpstream(t, "model-c", 15*time.Millisecond)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	post := func(stream bool, maxTokens int) (*http.Response, error) {
		body := `{"model":"chat","max_tokens":` + strconv.Itoa(maxTokens) + `,"stream":` + map[bool]string{true: "true", false: "false"}[stream] +
			`,"messages":[{"role":"user","content":"hi"}]}`
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions", strings.NewReader(body))
		return http.DefaultClient.Do(req)
	}
	resp, err := post(true, tokens)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	readEvent := func() (string, error) {
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return "", err
			}
			if strings.HasPrefix(line, "data: ") {
				return strings.TrimSpace(strings.TrimPrefix(line, "data: ")), nil
			}
		}
	}
	if _, err := readEvent(); err != nil {
		t.Fatalf("first event: %v", err)
	}
	serving, other, otherUp := "b", "c", uc
	if uc.requests.Load() == 1 {
		serving, other, otherUp = "c", "b", ub
	}

	// SIGTERM the serving node mid-stream.
	n := tm.nodes[serving]
	n.cancel()
	waitFor(t, "a to forget "+serving, func() bool { return a.resolvesTo("chat", other) })

	// New requests are answered, by the other node, while the stream drains.
	before := otherUp.requests.Load()
	for i := range 3 {
		r, err := post(false, 4)
		if err != nil {
			t.Fatalf("request %d during the drain: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			t.Errorf("request %d during the drain: status %d, want 200", i, r.StatusCode)
		}
	}
	if got := otherUp.requests.Load() - before; got != 3 {
		t.Errorf("%s served %d of the 3 requests sent during the drain, want all", other, got)
	}

	// The stream runs to its end.
	events := 1
	for {
		ev, err := readEvent()
		if err != nil {
			t.Fatalf("the stream through %s broke after %d events: %v", serving, events, err)
		}
		if ev == "[DONE]" {
			break
		}
		events++
	}
	if events < tokens/2 {
		t.Errorf("the stream had %d events, want about %d", events, tokens)
	}
	select {
	case err := <-n.done:
		n.stopped = true
		if err != nil {
			t.Errorf("%s: Run: %v", serving, err)
		}
	case <-ctx.Done():
		t.Fatalf("%s did not stop after its drain", serving)
	}
	scores := a.agent.PeerScores()
	if i := slices.IndexFunc(scores, func(p proxy.PeerScore) bool { return p.Node == serving }); i >= 0 && (scores[i].Failures > 0 || scores[i].CooledDown) {
		t.Errorf("a's view of %s after its graceful stop = %+v, want no failure", serving, scores[i])
	}
}

// TestRemoteDrainDeadlineAborts: a stream still running when the stopping
// node's drain deadline (proxy.shutdown_timeout) passes is cut, and the
// client sees an abort, never a clean [DONE]. The peer closed in order, so
// the cut is not its failure in the consumer's scores.
func TestRemoteDrainDeadlineAborts(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.shutdown = 300 * time.Millisecond
	ub := startUpstream(t, "model-b", 20*time.Millisecond) // 400 tokens: 8s
	a, _ := tm.chatFromB(ub)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions",
		strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	tm.stop("b") // returns once b's drain gave up and it stopped
	var readErr error
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			readErr = err
			break
		}
		if strings.HasPrefix(line, "data: [DONE]") {
			t.Fatal("the cut stream ended as if complete")
		}
	}
	if readErr == io.EOF {
		t.Errorf("the cut stream ended with a clean EOF; want an abort")
	}
	if ctx.Err() != nil {
		t.Fatal("the stream was still open at the test's deadline")
	}
	for _, p := range a.agent.PeerScores() {
		if p.Node == "b" && (p.Failures > 0 || p.CooledDown) {
			t.Errorf("a's view of b after its orderly stop = %+v, want no failure", p)
		}
	}
}
