package proxy

import (
	"net/http"
	"sort"
)

// Liveness and readiness, as load balancers and orchestrators probe them:
// GET /health answers 200 while the agent serves; GET /ready answers 200
// when every role has at least one candidate (a local instance, or a peer
// allowed both ways), else 503 naming the roles without one. Probes are not
// in the access log.

const (
	pathHealth = "/health"
	pathReady  = "/ready"
)

// Readiness is the answer of /ready.
type Readiness struct {
	Ready bool `json:"ready"`
	// Candidates is how many candidates each role has now.
	Candidates map[string]int `json:"candidates"`
	// Unready lists the roles without a candidate.
	Unready []string `json:"unready,omitempty"`
}

// Readiness reports whether every one of roles has a candidate now.
func (p *Proxy) Readiness(roles []string) Readiness {
	r := Readiness{Ready: true, Candidates: make(map[string]int, len(roles))}
	for _, role := range roles {
		n := len(p.cfg.Resolver.Resolve(role))
		r.Candidates[role] = n
		if n == 0 {
			r.Ready = false
			r.Unready = append(r.Unready, role)
		}
	}
	sort.Strings(r.Unready)
	return r
}

// ProbeHandler answers /health and /ready for roles (called per probe)
// and passes every other request to next (nil: 404).
func (p *Proxy) ProbeHandler(roles func() []string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case pathHealth, pathReady:
		default:
			if next == nil {
				WriteError(w, errNotFound(r.URL.Path))
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			WriteError(w, errMethod(r.Method))
			return
		}
		w.Header().Set("Cache-Control", "no-store")
		if r.URL.Path == pathHealth {
			writeJSON(w, http.StatusOK, struct {
				Status string `json:"status"`
			}{"ok"})
			return
		}
		rd := p.Readiness(roles())
		status := http.StatusOK
		if !rd.Ready {
			status = http.StatusServiceUnavailable
		}
		writeJSON(w, status, rd)
	})
}
