package proxy

import (
	"encoding/json"
	"net/http"
	"testing"
)

// TestProbesOnTheRolePort: /health is 200 while the proxy serves; /ready
// is 503 until the role has a candidate, then 200. Probes stay out of the
// request path (no 404 for the role's API).
func TestProbesOnTheRolePort(t *testing.T) {
	e := newEnv(t, Config{})
	get := func(path string) (int, Readiness) {
		t.Helper()
		resp, err := http.Get(e.url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var rd Readiness
		_ = json.NewDecoder(resp.Body).Decode(&rd)
		return resp.StatusCode, rd
	}
	if st, _ := get(pathHealth); st != 200 {
		t.Errorf("/health = %d, want 200", st)
	}
	if st, rd := get(pathReady); st != 503 || rd.Ready || len(rd.Unready) != 1 || rd.Unready[0] != "chat" {
		t.Errorf("/ready without an instance = %d %+v, want 503 naming chat", st, rd)
	}
	e.demo(0)
	if st, rd := get(pathReady); st != 200 || !rd.Ready || rd.Candidates["chat"] != 1 {
		t.Errorf("/ready with an instance = %d %+v, want 200", st, rd)
	}
	resp, err := http.Post(e.url+pathReady, "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /ready = %d, want 405", resp.StatusCode)
	}
}
