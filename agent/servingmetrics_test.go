package agent

import (
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

// exposition scrapes a's metrics.
func exposition(t *testing.T, a *Agent) string {
	t.Helper()
	rec := httptest.NewRecorder()
	a.metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}

// TestServingMetricsAcrossTheMesh: a stream a's app sends to b is counted
// on a as an app's request answered by b, and on b as a peer's answered
// locally, with the first token and the usage the instance reported on
// both.
func TestServingMetricsAcrossTheMesh(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 0)
	a, b := tm.chatFromB(ub)
	resp, err := http.Post(a.url("chat")+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"chat","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "[DONE]") {
		t.Fatalf("stream: %d %q", resp.StatusCode, body)
	}
	for _, c := range []struct {
		n      *meshNode
		labels string
	}{{a, `role="chat",source="app",target="b"`}, {b, `role="chat",source="peer",target="local"`}} {
		want := []string{
			`infermesh_requests_total{code="200",` + c.labels + `} 1`,
			`infermesh_time_to_first_token_seconds_count{` + c.labels + `} 1`,
			`infermesh_tokens_total{kind="completion",` + c.labels + `} 400`,
		}
		// b counts the request once its relay ended, which may be just
		// after a's client read the end.
		waitFor(t, c.n.name+"'s metrics", func() bool {
			exp := exposition(t, c.n.agent)
			return !slices.ContainsFunc(want, func(w string) bool { return !strings.Contains(exp, w) })
		})
	}
}
