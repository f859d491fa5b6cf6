package proxy

import (
	"io"
	"net/http"
	"testing"
)

// TestUpstreamKey: an instance that requires an API key answers 401 to the
// app's own Authorization, and 200 once the proxy sends the role's key in
// its place, with either server.
func TestUpstreamKey(t *testing.T) {
	for _, server := range []string{ServerInfermesh, ServerStd} {
		for _, key := range []string{"", "sk-upstream"} {
			t.Run(server+"/key="+key, func(t *testing.T) {
				e := newEnv(t, Config{Server: server, UpstreamKey: func(role string) string {
					if role == "chat" {
						return key
					}
					return ""
				}})
				var got []string
				e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					got = r.Header.Values("Authorization")
					if r.Header.Get("Authorization") != "Bearer sk-upstream" {
						w.WriteHeader(http.StatusUnauthorized)
						return
					}
					w.Header().Set("Content-Type", "application/json")
					_, _ = io.WriteString(w, `{"model":"m"}`)
				}), "m")
				resp := e.post(pathChat, `{"model":"chat"}`, "Authorization", "Bearer sk-app")
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				want, wantAuth := http.StatusOK, "Bearer sk-upstream"
				if key == "" {
					want, wantAuth = http.StatusUnauthorized, "Bearer sk-app"
				}
				if resp.StatusCode != want || len(got) != 1 || got[0] != wantAuth {
					t.Errorf("status %d, instance saw Authorization %q; want %d and [%s]", resp.StatusCode, got, want, wantAuth)
				}
			})
		}
	}
}
