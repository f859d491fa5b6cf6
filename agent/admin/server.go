// Package admin is the agent's admin API: HTTP+JSON over a Unix socket,
// routes versioned under /v0/, and the client the infermesh CLI uses.
//
// Who may do what is decided per connection from the kernel's peer
// credentials (SO_PEERCRED): root, the agent's own user and members of the
// configured admin group may change things; every other local user may
// only read. Gossip keys are named by fingerprint: the keys themselves are
// sent only when asked for (GET /v0/keyring?secrets=true), and only to
// callers that may change things. Requests carrying Origin or Referer,
// or a Host other than the socket's fixed name, are refused, so a browser
// tricked into talking to the socket gets nothing.
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// Host is the fixed Host of every admin request.
const Host = "infermesh.sock"

// maxBody bounds request bodies.
const maxBody = 64 << 10

// Config configures a Server. Zero values mean the defaults.
type Config struct {
	// Backend answers every request. Required.
	Backend Backend
	// Group (name or numeric id) may change things besides root and the
	// agent's own user. Empty: nobody else.
	Group string
	// Metrics serves GET /metrics. Nil: 404.
	Metrics http.Handler
	// OnRefused is told about every refused request (for the audit). It
	// must not block.
	OnRefused func(c Caller, method, path, why string)
	// Logger; nil is a no-op logger.
	Logger *zap.Logger
}

// Server is the admin API server. Create it with New.
type Server struct {
	cfg      Config
	gid      int // -1: no admin group
	agentUID uint32
	log      *zap.Logger
	hs       *http.Server

	baseCtx context.Context
	cancel  context.CancelFunc
}

// New validates cfg and returns a Server that serves nothing until Serve.
func New(cfg Config) (*Server, error) {
	if cfg.Backend == nil {
		return nil, errors.New("admin: Config.Backend is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	s := &Server{cfg: cfg, gid: -1, agentUID: uint32(os.Geteuid()), log: cfg.Logger}
	if cfg.Group != "" {
		gid, err := LookupGroup(cfg.Group)
		if err != nil {
			return nil, fmt.Errorf("admin: Config.Group: %w", err)
		}
		s.gid = gid
	}
	s.baseCtx, s.cancel = context.WithCancel(context.Background())
	s.hs = &http.Server{
		Handler:           s.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          zap.NewStdLog(s.log.Named("http")),
		// Streams (events) end when the base context does: see Shutdown.
		BaseContext: func(net.Listener) context.Context { return s.baseCtx },
		ConnContext: s.connContext,
	}
	return s, nil
}

// connContext identifies the peer once per connection.
func (s *Server) connContext(ctx context.Context, c net.Conn) context.Context {
	cred, err := peerCred(c)
	if err != nil {
		s.log.Warn("admin connection without peer credentials", zap.Error(err))
		return ctx
	}
	caller := Caller{UID: cred.Uid, GID: cred.Gid, PID: cred.Pid}
	caller.Write = cred.Uid == 0 || cred.Uid == s.agentUID ||
		(s.gid >= 0 && (int(cred.Gid) == s.gid || inGroup(cred.Pid, cred.Uid, s.gid)))
	return context.WithValue(ctx, callerKey{}, caller)
}

// Serve serves ln until Shutdown or Close; it then returns nil.
func (s *Server) Serve(ln net.Listener) error {
	err := s.hs.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown ends every event stream, stops accepting and waits (until ctx
// ends) for requests in flight. It is idempotent.
func (s *Server) Shutdown(ctx context.Context) error {
	s.cancel()
	err := s.hs.Shutdown(ctx)
	if err != nil {
		_ = s.hs.Close()
	}
	return err
}

// Close stops at once. It is idempotent.
func (s *Server) Close() error {
	s.cancel()
	return s.hs.Close()
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	b := s.cfg.Backend
	read := func(pattern string, h func(w http.ResponseWriter, r *http.Request, c Caller)) {
		mux.HandleFunc("GET "+pattern, s.guard(false, h))
	}
	write := func(pattern string, h func(w http.ResponseWriter, r *http.Request, c Caller)) {
		mux.HandleFunc("POST "+pattern, s.guard(true, h))
	}

	read("/v0/status", func(w http.ResponseWriter, r *http.Request, _ Caller) { reply(w, r, b.Status) })
	read("/v0/peers", func(w http.ResponseWriter, r *http.Request, _ Caller) { reply(w, r, b.Peers) })
	read("/v0/roles", func(w http.ResponseWriter, r *http.Request, _ Caller) { reply(w, r, b.Roles) })
	read("/v0/route/{role}", func(w http.ResponseWriter, r *http.Request, _ Caller) {
		reply(w, r, func(ctx context.Context) (Route, error) { return b.Route(ctx, r.PathValue("role")) })
	})
	read("/v0/policy", func(w http.ResponseWriter, r *http.Request, _ Caller) { reply(w, r, b.Policy) })
	write("/v0/policy", func(w http.ResponseWriter, r *http.Request, c Caller) {
		var pc PolicyChange
		if decode(w, r, &pc) {
			reply(w, r, func(ctx context.Context) (PolicyResult, error) { return b.SetPolicy(ctx, c, pc) })
		}
	})
	write("/v0/policy/reset", func(w http.ResponseWriter, r *http.Request, c Caller) {
		var f PolicyFilter
		if decode(w, r, &f) {
			reply(w, r, func(ctx context.Context) (ResetResult, error) { return b.ResetPolicy(ctx, c, f) })
		}
	})
	read("/v0/keyring", func(w http.ResponseWriter, r *http.Request, c Caller) {
		// The keys themselves only when asked (?secrets=true), and only
		// to callers that may change things; fingerprints name them
		// everywhere else.
		secrets := false
		if v := r.URL.Query().Get("secrets"); v != "" {
			var err error
			if secrets, err = strconv.ParseBool(v); err != nil {
				writeError(w, Errorf(ErrInvalid, "secrets=%q is not a boolean", v))
				return
			}
		}
		if secrets && !c.Write {
			why := fmt.Sprintf("uid %d may not read the gossip keys themselves; that needs root, uid %d%s", c.UID, s.agentUID, s.groupHint())
			if s.cfg.OnRefused != nil {
				s.cfg.OnRefused(c, r.Method, r.URL.Path+"?secrets=true", why)
			}
			writeError(w, Errorf(ErrForbidden, "permission denied: %s", why))
			return
		}
		reply(w, r, func(ctx context.Context) (Keyring, error) {
			k, err := b.Keyring(ctx)
			if !secrets {
				k = redact(k)
			}
			return k, err
		})
	})
	write("/v0/keyring/{op}", func(w http.ResponseWriter, r *http.Request, c Caller) {
		var kc KeyringChange
		if !decode(w, r, &kc) {
			return
		}
		kc.Op = r.PathValue("op")
		switch kc.Op {
		case KeyringInstall, KeyringUse, KeyringRemove, KeyringRotate:
		default:
			writeError(w, Errorf(ErrNotFound, "keyring operation %q is not install, use, remove or rotate", kc.Op))
			return
		}
		reply(w, r, func(ctx context.Context) (Keyring, error) {
			k, err := b.ChangeKeyring(ctx, c, kc)
			return redact(k), err // the caller sent the key; it is not sent back
		})
	})
	read("/v0/events", s.events)
	write("/v0/reload", func(w http.ResponseWriter, r *http.Request, c Caller) {
		reply(w, r, func(ctx context.Context) (ReloadResult, error) { return b.Reload(ctx, c) })
	})
	read("/v0/instances", func(w http.ResponseWriter, r *http.Request, _ Caller) { reply(w, r, b.Instances) })
	read("/v0/instances/{role}/logs", func(w http.ResponseWriter, r *http.Request, _ Caller) {
		n := 100
		if q := r.URL.Query().Get("n"); q != "" {
			v, err := strconv.Atoi(q)
			if err != nil {
				writeError(w, Errorf(ErrInvalid, "n=%q is not a number", q))
				return
			}
			n = v
		}
		follow := false
		if q := r.URL.Query().Get("follow"); q != "" {
			f, err := strconv.ParseBool(q)
			if err != nil {
				writeError(w, Errorf(ErrInvalid, "follow=%q is not a boolean", q))
				return
			}
			follow = f
		}
		if follow {
			s.followLogs(w, r, r.PathValue("role"), n)
			return
		}
		reply(w, r, func(ctx context.Context) ([]LogLine, error) { return b.InstanceLogs(ctx, r.PathValue("role"), n) })
	})
	write("/v0/instances/{role}/stop", func(w http.ResponseWriter, r *http.Request, c Caller) {
		reply(w, r, func(ctx context.Context) (Instance, error) { return b.StopInstance(ctx, c, r.PathValue("role")) })
	})
	write("/v0/instances/{role}/retry", func(w http.ResponseWriter, r *http.Request, c Caller) {
		reply(w, r, func(ctx context.Context) (Instance, error) { return b.RetryInstance(ctx, c, r.PathValue("role")) })
	})
	write("/v0/instances/{role}/pull", func(w http.ResponseWriter, r *http.Request, c Caller) {
		pb, ok := b.(PullBackend)
		if !ok {
			writeError(w, Errorf(ErrNotConfigured, "pulling images is not available"))
			return
		}
		role := r.PathValue("role")
		s.nodeStream(w, r, func(emit func(NodeEvent) error) error {
			err := pb.PullInstance(r.Context(), c, role, func(line string) error {
				return emit(NodeEvent{Time: time.Now().UTC(), Kind: NodeEventLog, Line: line})
			})
			if err == nil {
				return emit(NodeEvent{Time: time.Now().UTC(), Kind: NodeEventDone, Message: "image ready for role " + role})
			}
			return err
		})
	})
	read("/metrics", func(w http.ResponseWriter, r *http.Request, _ Caller) {
		if s.cfg.Metrics == nil {
			writeError(w, Errorf(ErrNotConfigured, "metrics are not enabled"))
			return
		}
		s.cfg.Metrics.ServeHTTP(w, r)
	})
	s.nodeRoutes(mux)
	s.meshRoutes(mux)
	s.meshViewRoutes(mux)
	s.routeRequestRoutes(mux)
	s.consoleRoutes(mux)
	mux.HandleFunc("/", s.guard(false, func(w http.ResponseWriter, r *http.Request, _ Caller) {
		writeError(w, Errorf(ErrNotFound, "no such admin route: %s %s", r.Method, r.URL.Path))
	}))
	return mux
}

// guard refuses cross-origin requests, unidentified callers and, for
// changes, callers that may only read.
func (s *Server) guard(change bool, h func(w http.ResponseWriter, r *http.Request, c Caller)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		c, ok := callerFrom(r.Context())
		var why string
		switch {
		case !ok:
			why = "the caller's credentials are unknown"
		case r.Header.Get("Origin") != "" || r.Header.Get("Referer") != "":
			why = "cross-origin requests are refused"
		case r.Host != Host:
			why = fmt.Sprintf("Host %q is not %q", r.Host, Host)
		case change && !c.Write:
			why = fmt.Sprintf("uid %d may only read; changes need root, uid %d%s", c.UID, s.agentUID, s.groupHint())
		}
		if why != "" {
			if s.cfg.OnRefused != nil {
				s.cfg.OnRefused(c, r.Method, r.URL.Path, why)
			}
			writeError(w, Errorf(ErrForbidden, "permission denied: %s", why))
			return
		}
		h(w, r, c)
	}
}

func (s *Server) groupHint() string {
	if s.gid < 0 {
		return ""
	}
	return " or group " + s.cfg.Group
}

// redact drops the keys themselves, keeping their fingerprints.
func redact(k Keyring) Keyring {
	keys := make([]GossipKey, len(k.Keys))
	for i, g := range k.Keys {
		g.Key = ""
		keys[i] = g
	}
	k.Keys = keys
	return k
}

// events streams the audit as newline-delimited JSON until the client
// goes or the server shuts down; ?last=N sends only the last N events of
// the recent history, ?follow=false ends the stream after it.
func (s *Server) events(w http.ResponseWriter, r *http.Request, _ Caller) {
	o := EventsOptions{Follow: true}
	q := r.URL.Query()
	if v := q.Get("follow"); v != "" {
		f, err := strconv.ParseBool(v)
		if err != nil {
			writeError(w, Errorf(ErrInvalid, "follow=%q is not a boolean", v))
			return
		}
		o.Follow = f
	}
	if v := q.Get("last"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			writeError(w, Errorf(ErrInvalid, "last=%q is not a count", v))
			return
		}
		o.Last = n
	}
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_ = rc.Flush()
	enc := json.NewEncoder(w)
	err := s.cfg.Backend.Events(r.Context(), o, func(e Event) error {
		if err := enc.Encode(e); err != nil {
			return err
		}
		return rc.Flush()
	})
	if err != nil && r.Context().Err() == nil {
		s.log.Debug("event stream ended", zap.Error(err))
	}
}

// LogStreamEnd is the Stream of the last line of a followed log that
// ended because the role has no instance any more; its Line says so.
const LogStreamEnd = "end"

// followLogs streams role's log as newline-delimited JSON LogLines until
// the client goes, the server shuts down (the stream just ends) or the
// role's instance goes away (a last line of stream LogStreamEnd).
func (s *Server) followLogs(w http.ResponseWriter, r *http.Request, role string, n int) {
	lb, ok := s.cfg.Backend.(LogsBackend)
	if !ok {
		writeError(w, Errorf(ErrNotConfigured, "following instance logs is not available"))
		return
	}
	// A role without an instance is an ordinary error, before the stream.
	if _, err := s.cfg.Backend.InstanceLogs(r.Context(), role, 1); err != nil {
		writeError(w, err)
		return
	}
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_ = rc.Flush()
	enc := json.NewEncoder(w)
	err := lb.FollowInstanceLogs(r.Context(), role, n, func(l LogLine) error {
		if err := enc.Encode(l); err != nil {
			return err
		}
		return rc.Flush()
	})
	switch {
	case errors.Is(err, ErrNotFound):
		_ = enc.Encode(LogLine{Time: time.Now().UTC(), Stream: LogStreamEnd, Line: err.Error()})
		_ = rc.Flush()
	case err != nil && r.Context().Err() == nil:
		s.log.Debug("log stream ended", zap.String("role", role), zap.Error(err))
	}
}

func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil && !errors.Is(err, io.EOF) {
		writeError(w, Errorf(ErrInvalid, "request body: %v", err))
		return false
	}
	return true
}

func reply[T any](w http.ResponseWriter, r *http.Request, f func(context.Context) (T, error)) {
	v, err := f(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b, _ = json.Marshal(errorBody{APIError{Code: codeInternal, Message: err.Error()}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func writeError(w http.ResponseWriter, err error) {
	status, code := http.StatusInternalServerError, codeInternal
	switch {
	case errors.Is(err, ErrForbidden):
		status, code = http.StatusForbidden, codeForbidden
	case errors.Is(err, ErrInvalid):
		status, code = http.StatusBadRequest, codeInvalid
	case errors.Is(err, ErrNotFound):
		status, code = http.StatusNotFound, codeNotFound
	case errors.Is(err, ErrConflict):
		status, code = http.StatusConflict, codeConflict
	case errors.Is(err, ErrNotConfigured):
		status, code = http.StatusServiceUnavailable, codeNotConfigured
	}
	writeJSON(w, status, errorBody{APIError{Code: code, Message: err.Error()}})
}
