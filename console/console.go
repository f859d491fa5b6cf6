// Package console is the agent's web console: a read-only page on a
// loopback port (admin.console) showing the mesh as this node sees it (a
// map of the nodes with an arrow from each consumer to the nodes serving
// it each role), the roles and their candidates, the recent requests and
// the audit events, updated live over server-sent events.
//
// Access, default deny:
//   - the listener binds loopback only (New refuses anything else);
//   - every request needs the token the agent made at start (kept in a
//     0600 file; `infermesh console` prints the URL holding it): as
//     ?token= on the first visit, which sets an HttpOnly, SameSite=Strict
//     cookie and redirects to the URL without it, then the cookie, or an
//     Authorization: Bearer header;
//   - the Host must name loopback (a page elsewhere that resolved its own
//     name to 127.0.0.1, DNS rebinding, sends its own name), and an Origin,
//     when sent, must be the console's own;
//   - only GET and HEAD are answered: nothing on the page changes the
//     agent.
//
// Everything the page loads is embedded (go:embed): it works offline and
// its Content-Security-Policy allows nothing from elsewhere.
package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/proxy"
)

//go:embed assets
var assets embed.FS

// Source is what the console shows. The agent's admin backend and its ring
// of recent requests implement it. Methods are called from request
// goroutines, concurrently, and must return when ctx ends.
type Source interface {
	Status(ctx context.Context) (admin.Status, error)
	MeshView(ctx context.Context) (admin.MeshView, error)
	Roles(ctx context.Context) ([]admin.Role, error)
	Route(ctx context.Context, role string) (admin.Route, error)
	Events(ctx context.Context, o admin.EventsOptions, fn func(admin.Event) error) error
	RecentRequests() []admin.RecentRequest
}

// Config configures a console.
type Config struct {
	// Listen is the loopback host:port to bind (port 0 picks one).
	Listen string
	// Token is the secret a request must carry. Required, at least 32
	// characters; NewToken makes one.
	Token  string
	Source Source
	// Interval is how often the live stream sends the state. Default 1s.
	Interval time.Duration
	Logger   *zap.Logger
}

// State is what the page shows, as /api/state answers and the live stream
// sends it.
type State struct {
	Status admin.Status          `json:"status"`
	Mesh   admin.MeshView        `json:"mesh"`
	Roles  []admin.Role          `json:"roles"`
	Routes []admin.Route         `json:"routes"`
	Recent []admin.RecentRequest `json:"recent"`
	Events []admin.Event         `json:"events"`
}

// recentShown and eventsShown bound the lists the page gets.
const (
	recentShown = 50
	eventsShown = 50
)

// cookieName holds the token once the first visit gave it.
const cookieName = "infermesh_console"

// Server is a running console.
type Server struct {
	cfg  Config
	ln   net.Listener
	hs   *http.Server
	log  *zap.Logger
	done chan struct{}
	once sync.Once
}

// NewToken returns a fresh random token (32 bytes, hex).
func NewToken() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// New binds cfg.Listen, which must be a loopback address.
func New(cfg Config) (*Server, error) {
	if !proxy.IsLoopbackAddr(cfg.Listen) {
		return nil, fmt.Errorf("console: listen %q: the console binds a loopback address only", cfg.Listen)
	}
	if len(cfg.Token) < 32 {
		return nil, errors.New("console: the token is shorter than 32 characters")
	}
	if cfg.Source == nil {
		return nil, errors.New("console: no source")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	s := &Server{cfg: cfg, ln: ln, log: cfg.Logger, done: make(chan struct{})}
	s.hs = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	return s, nil
}

// Addr is the bound address.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// URL is the console's address with the token: what `infermesh console`
// prints.
func (s *Server) URL() string {
	return "http://" + s.ln.Addr().String() + "/?token=" + url.QueryEscape(s.cfg.Token)
}

// Serve answers until Shutdown or Close.
func (s *Server) Serve() error {
	err := s.hs.Serve(s.ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown ends the live streams and waits for the requests in flight
// until ctx ends.
func (s *Server) Shutdown(ctx context.Context) error {
	s.once.Do(func() { close(s.done) })
	return s.hs.Shutdown(ctx)
}

// Handler is the console's handler, guards included.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(assets, "assets")
	files := http.FileServerFS(static)
	mux.Handle("GET /{$}", files)
	mux.Handle("GET /app.js", files)
	mux.Handle("GET /style.css", files)
	mux.HandleFunc("GET /api/state", func(w http.ResponseWriter, r *http.Request) {
		st, err := s.state(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(st)
	})
	mux.HandleFunc("GET /api/stream", s.stream)
	return s.guard(mux)
}

// guard refuses what the package doc says it refuses, and sets the
// headers every answer carries.
func (s *Server) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		if !proxy.LoopbackHost(r.Host) {
			http.Error(w, "the console answers only requests for a loopback host", http.StatusForbidden)
			return
		}
		if o := r.Header.Get("Origin"); o != "" && o != "http://"+r.Host {
			http.Error(w, "the console answers only its own pages", http.StatusForbidden)
			return
		}
		if r.Header.Get("Sec-Fetch-Site") == "cross-site" {
			http.Error(w, "the console answers only its own pages", http.StatusForbidden)
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			h.Set("Allow", "GET, HEAD")
			http.Error(w, "the console is read-only", http.StatusMethodNotAllowed)
			return
		}
		if tok := r.URL.Query().Get("token"); tok != "" {
			if !s.tokenOK(tok) {
				http.Error(w, "wrong token: run `infermesh console` for the URL", http.StatusUnauthorized)
				return
			}
			http.SetCookie(w, &http.Cookie{Name: cookieName, Value: s.cfg.Token, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
			u := *r.URL
			q := u.Query()
			q.Del("token")
			u.RawQuery = q.Encode()
			http.Redirect(w, r, u.RequestURI(), http.StatusSeeOther)
			return
		}
		if !s.authorized(r) {
			http.Error(w, "no token: run `infermesh console` for the URL", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) tokenOK(tok string) bool {
	return subtle.ConstantTimeCompare([]byte(tok), []byte(s.cfg.Token)) == 1
}

func (s *Server) authorized(r *http.Request) bool {
	if c, err := r.Cookie(cookieName); err == nil && s.tokenOK(c.Value) {
		return true
	}
	if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && s.tokenOK(b) {
		return true
	}
	return false
}

// state gathers the page's state from the source.
func (s *Server) state(ctx context.Context) (State, error) {
	var st State
	var err error
	if st.Status, err = s.cfg.Source.Status(ctx); err != nil {
		return st, err
	}
	if st.Mesh, err = s.cfg.Source.MeshView(ctx); err != nil {
		return st, err
	}
	if st.Roles, err = s.cfg.Source.Roles(ctx); err != nil {
		return st, err
	}
	st.Routes = []admin.Route{}
	for _, r := range st.Roles {
		if rt, err := s.cfg.Source.Route(ctx, r.Name); err == nil {
			st.Routes = append(st.Routes, rt)
		}
	}
	st.Recent = s.cfg.Source.RecentRequests()
	if len(st.Recent) > recentShown {
		st.Recent = st.Recent[:recentShown]
	}
	st.Events = []admin.Event{}
	err = s.cfg.Source.Events(ctx, admin.EventsOptions{Last: eventsShown}, func(e admin.Event) error {
		st.Events = append(st.Events, e)
		return nil
	})
	return st, err
}

// stream sends the state as an SSE event named state at once and then
// every interval, until the client leaves or the console shuts down.
func (s *Server) stream(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		st, err := s.state(r.Context())
		if err != nil {
			if r.Context().Err() != nil {
				return
			}
			s.log.Warn("console state", zap.Error(err))
		} else {
			b, _ := json.Marshal(st)
			if _, err := fmt.Fprintf(w, "event: state\ndata: %s\n\n", b); err != nil {
				return
			}
			if rc.Flush() != nil {
				return
			}
		}
		select {
		case <-r.Context().Done():
			return
		case <-s.done:
			return
		case <-t.C:
		}
	}
}
