// Package proxy serves the loopback OpenAI-compatible endpoints apps talk to,
// forwards each request to the candidate placement resolves for its role (the
// local instance, else an admitted peer over the mesh transport), and serves
// requests forwarded by peers from the local instance only. It decides
// neither who is a candidate (package placement, fed by mesh's adverts) nor
// who a peer is (mesh verifies the QUIC connection; PeerHandler is told the
// node id), and it carries no QUIC itself: Config.Remote is mesh's
// Transport, wrapped by a PeerScorer.
//
// # Words
//
// A role is a name apps use as their model ("chat"); its port is the
// loopback listener of that role, and proxy.listen the shared port for
// every role. A candidate is a placement.Candidate: the local instance
// (KindLocal, a base URL on this host) or a peer (KindRemote, a node id).
// An attempt is one try of one candidate; a request ends after the first
// attempt whose response started, or after the last. A pinned instance
// knows its model by another name than the role (Candidate.Model): the
// body is sent with that name and the answer carries back the name the
// app asked for ("asked", a JSON string literal). Source is "app" (a role
// port or the shared port) or "peer" (a request a peer forwarded here).
// A refusal is a peer agent's own answer that it will not serve this node
// (RefusedHeader), never an instance's.
//
// # The request path
//
// An app's request on a role port:
//
//	h1Server (or stdServer)     connection limits, head and body bounds, keep-alive, reqCtx
//	ProbeHandler                /health and /ready, never logged
//	traced                      X-Request-Id, ServedByHeader, the access log line
//	RoleHandler                 routeApp (Host, Origin, path, method); readBody within
//	                            MaxBodyBytes and the body-memory budget; the model asked
//	                            for; Resolver.Resolve(role); 404 or 503 before any attempt
//	forward                     the candidates in order, skipping one that fails before
//	                            its response starts (an error, a refusal, a 503 while
//	                            another candidate is left)
//	  roundTripLocal            the pinned body to the instance: upstreamClient (one
//	                            write, one read buffer) for plain http, http.Transport
//	                            for other bases and under ServerStd
//	  roundTripRemote           MeshHeaders only, no query, RoleHeader, to Config.Remote
//	respond                     the answer relayed: PeerResponseHeaders from a peer, the
//	                            model put back (in place up to pinnedHoldMax, else
//	                            modelStream), SSE event by event (copySSE), metered (meter)
//
// A peer's request arrives from mesh's HTTP/3 server at PeerHandler: the
// identity mesh verified, the role from RoleHeader, LocalForPeer(role,
// peer) or a refusal; then readBody and forward with the local instance as
// the only candidate, so a request served for a peer never leaves the
// host. The shared port (ListenShared) picks the role from the body's
// model (routeModel) and goes on as the role port's request.
//
// # Files
//
//   - proxy.go: Config and its defaults, Proxy, the Resolver, PeerResolver
//     and Observer contracts, Outcome, and the listeners' life: Listen,
//     Close, Retire (a role leaving on reload, drained alone) and Shutdown.
//   - handler.go: RoleHandler and PeerHandler, the app-facing checks
//     (routeApp), /v1/models of a role, the request body (bodyBuf, pooled
//     and reference counted) and the memory budget of bodies in flight
//     (memBudget; the first 64 KiB of each body are free).
//   - shared.go: the shared port, one base URL for every role.
//   - forward.go: forward, the attempts and their order, respond, and the
//     copies of a body to the client (copyFlush, copySSE).
//   - headers.go: the headers that cross each hop (hopHeaders,
//     MeshHeaders, PeerResponseHeaders) and the request head written for
//     the upstream client.
//   - upstream.go, upstream_unix.go, upstream_other.go: upstreamClient, the
//     HTTP/1.1 client of local instances that replaces http.Transport on
//     the hot path: its pool, the stale-connection check (peerClosed peeks
//     for a FIN), the replay rule, and the response head parser bounded at
//     maxResponseHead.
//   - h1server.go, h1conn.go, h1request.go, h1response.go: h1Server, the
//     HTTP/1.1 server of the loopback ports that replaces net/http's there:
//     accept, admission and the drain (h1server.go), the connection's life
//     and the watch for a client gone (h1conn.go), the request parser
//     (stricter than net/http's where framing is ambiguous; the
//     differential fuzzers in h1diff_test.go and h1fuzz_test.go say where
//     and why) and the response writer (Content-Length or chunked).
//   - reqctx.go: reqCtx, the request context of h1Server, cheaper than
//     context.WithCancel.
//   - stdserver.go: stdServer, net/http's server under the same bounds
//     (Config.Server ServerStd, the known-good fallback), and the
//     httpServer interface both servers meet.
//   - limits.go: the connection limit (connLimiter; the default from the
//     open-file limit less fdReserve), deadlineConn's write deadline, the
//     grace a stop gives a slow client (shutdownGrace).
//   - peerscore.go: PeerScorer, a Resolver over placement's that puts
//     failing and refusing peers last, and its Transport around the
//     mesh's: the liveness probe after a third of FirstByte with no
//     response headers (ErrNoProgress), the bound on a peer's headers
//     (ErrHeaderTimeout), failures and successes counted per peer.
//   - jsonmodel.go: the body's top-level "model" found (modelSpan, over
//     internal/jsonskip) and replaced (rewriteModel) without decoding.
//   - jsonstream.go: modelStream, the same rewrite for an answer too large
//     to hold, and readPinned, which holds an answer up to pinnedHoldMax.
//   - usage.go: meter, which notes the first SSE event and the body's
//     tail, and the token usage read from it.
//   - reqlog.go: request ids, ServedByHeader and the access log (traced).
//   - probes.go: /health and /ready (Readiness).
//   - loopback_guard.go: the loopback checks: Host header (DNS rebinding), browser
//     Origin, IsLoopbackAddr for listen addresses.
//   - errors.go: APIError and WriteError, the OpenAI-shaped errors and
//     their codes.
//   - busy.go: requests at the local instance per role (LocalInFlight),
//     which the agent sets as the role's load in its adverts.
//
// docs/requests.md describes the same path for users: its failover, the
// headers that cross the hop, and the limits with their defaults.
package proxy
