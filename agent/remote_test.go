package agent

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/mesh"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/proxy"
)

// The three-agent tests run every node of a mesh in this process, each on
// its own 127.0.1.x address with real gossip (memberlist) and QUIC sockets,
// configured from YAML files the way infermeshd is.

var nextMeshIP atomic.Int32

// testUpstream is a demo model instance that records what reaches it.
type testUpstream struct {
	base      string
	demo      *demomodel.Server
	requests  atomic.Int32
	cancelled atomic.Int32 // requests whose context ended before the handler finished
	mu        sync.Mutex
	models    []string // the model field of every request body
	ids       []string // the X-Request-Id of every request
	auths     []string // the Authorization of every request
	agents    []string // the User-Agent of every request ("" for none)
	parents   []string // the traceparent of every request ("" for none)
	// key, when set, is the API key the instance requires (as vLLM's
	// --api-key): any other Authorization gets 401.
	key  atomic.Pointer[string]
	stop func()
}

func startUpstream(t testing.TB, model string, tokenDelay time.Duration) *testUpstream {
	t.Helper()
	cfg := demomodel.DefaultConfig()
	cfg.Model = model
	cfg.TokenDelay = tokenDelay
	cfg.Tokens = 400
	demo, err := demomodel.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	u := &testUpstream{demo: demo}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			u.requests.Add(1)
			body, _ := io.ReadAll(r.Body)
			var m struct{ Model string }
			_ = json.Unmarshal(body, &m)
			u.mu.Lock()
			u.models = append(u.models, m.Model)
			u.ids = append(u.ids, r.Header.Get(proxy.RequestIDHeader))
			u.auths = append(u.auths, r.Header.Get("Authorization"))
			u.agents = append(u.agents, strings.Join(r.Header.Values("User-Agent"), ","))
			u.parents = append(u.parents, r.Header.Get("Traceparent"))
			u.mu.Unlock()
			r.Body = io.NopCloser(bytes.NewReader(body))
			if k := u.key.Load(); k != nil && r.Header.Get("Authorization") != "Bearer "+*k {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				_, _ = io.WriteString(w, `{"error":"Unauthorized"}`)
				return
			}
		}
		demo.ServeHTTP(w, r)
		if r.Context().Err() != nil {
			u.cancelled.Add(1)
		}
	}), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(ln) }()
	u.base = "http://" + ln.Addr().String()
	u.stop = func() { _ = hs.Close(); <-done }
	t.Cleanup(u.stop)
	return u
}

func (u *testUpstream) seenAgents() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.agents)
}

func (u *testUpstream) seenModels() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.models)
}

// roleSpec is one role of a test node's config.
type roleSpec struct {
	upstream   *testUpstream
	model      string
	expose     bool
	serveTo    []string
	acceptFrom []string
	keyFile    string // upstream_api_key_file
	extra      string // more keys of the role, one YAML line ("metrics: none")
}

// testMesh is a set of nodes sharing a gossip keyring and static trust.
type testMesh struct {
	t       testing.TB
	root    string
	keyring string
	nodes   map[string]*meshNode
	order   []string
	// quicDefaults keeps the transport's keep-alive and idle timeout at
	// their defaults (else shortened for quick tests).
	quicDefaults bool
	// shutdown is proxy.shutdown_timeout of every node (default 2s).
	shutdown time.Duration
	// joins overrides the node a node's mesh.join names ("": none; the
	// default is the first node, for every other node).
	joins  map[string]string
	shared map[string]bool // nodes that also serve proxy.listen (any free port)
	// meshTuning, when set, adjusts a node's mesh config after the fast
	// test defaults.
	meshTuning func(name string, c *mesh.Config)
	// transportTuning, when set, adjusts a node's QUIC transport config
	// after the test defaults.
	transportTuning func(name string, c *mesh.TransportConfig)
	// notify, when set, receives a node's readiness and status lines.
	notify func(name, state string)
	// authority, when set, admits every node by a full-scope certificate
	// it signs (trust.authority) instead of static trust.
	authority ed25519.PrivateKey
	// ownKeyrings gives every node a keyring file of its own, a copy of
	// the shared one made at its first start, as on separate hosts.
	ownKeyrings bool
	// meshYAML and proxyYAML add keys to a node's mesh section and to its
	// proxy mapping ("k: v, " items).
	meshYAML, proxyYAML map[string]string
	// adminYAML adds keys to a node's admin mapping ("k: v, " items);
	// extraYAML adds top-level sections to a node's config.
	adminYAML, extraYAML map[string]string
	// loggers is the logger of a node run in this process (default none).
	loggers map[string]*zap.Logger
	// procs runs these nodes as infermeshd processes (startProc).
	procs map[string]bool
}

type meshNode struct {
	name     string
	ip       string
	stateDir string
	pub      string
	bind     string
	quic     string
	pc       net.PacketConn // the QUIC socket when the test owns it (to kill it)
	frozen   *freezableConn // pc, which the test can freeze
	cfgPath  string
	proc     *agentProc     // when run as its own process
	ports    map[string]int // role -> port, of a node run as a process
	agent    *Agent
	cancel   context.CancelFunc
	done     chan error
	stopped  bool
}

func newTestMesh(t testing.TB, names ...string) *testMesh {
	t.Helper()
	root := t.TempDir()
	tm := &testMesh{t: t, root: root, keyring: filepath.Join(root, "keyring.json"), nodes: map[string]*meshNode{}}
	if _, err := identity.WriteNewKeyring(tm.keyring); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		ip := fmt.Sprintf("127.0.1.%d", 10+nextMeshIP.Add(1)%240)
		n := &meshNode{name: name, ip: ip, stateDir: filepath.Join(root, name)}
		if err := os.MkdirAll(n.stateDir, 0o700); err != nil {
			t.Fatal(err)
		}
		key, err := identity.WriteNewKey(filepath.Join(n.stateDir, identity.NodeKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		n.pub = identity.EncodeNodeKey(key.Public().(ed25519.PublicKey))
		n.bind = net.JoinHostPort(ip, fmt.Sprint(testnet.TCPUDPPort(t, ip)))
		tm.nodes[name] = n
		tm.order = append(tm.order, name)
	}
	return tm
}

// start writes name's config file, loads it and runs the agent. ownSocket
// makes the test own the node's QUIC socket (so it can kill it); otherwise
// mesh.quic in the file is bound by the agent itself.
func (tm *testMesh) start(name string, roles map[string]roleSpec, ownSocket bool) *meshNode {
	t := tm.t
	t.Helper()
	n := tm.nodes[name]
	var quicPC net.PacketConn
	if ownSocket {
		pc, err := net.ListenPacket("udp", n.ip+":0")
		if err != nil {
			t.Fatal(err)
		}
		n.frozen = &freezableConn{PacketConn: pc}
		quicPC, n.pc = n.frozen, pc
		t.Cleanup(func() { pc.Close() })
		n.quic = pc.LocalAddr().String()
	} else {
		pc, err := net.ListenPacket("udp", n.ip+":0")
		if err != nil {
			t.Fatal(err)
		}
		n.quic = pc.LocalAddr().String()
		pc.Close()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "node: {name: %s, state_dir: %s}\n", name, n.stateDir)
	fmt.Fprintf(&b, "admin: {%ssocket: %s}\n", tm.adminYAML[name], filepath.Join(n.stateDir, "admin.sock"))
	fmt.Fprintf(&b, "mesh:\n  bind: %s\n  quic: %s\n  gossip_keyring: %s\n  advert_ttl: 3s\n", n.bind, n.quic, tm.keyringOf(n))
	b.WriteString(tm.meshYAML[name])
	if j, ok := tm.joins[name]; ok {
		if j != "" {
			fmt.Fprintf(&b, "  join: [%s]\n", tm.nodes[j].bind)
		}
	} else if name != tm.order[0] {
		fmt.Fprintf(&b, "  join: [%s]\n", tm.nodes[tm.order[0]].bind)
	}
	if tm.authority != nil {
		fmt.Fprintf(&b, "trust:\n  authority: %q\n  certificate: %q\n", identity.EncodeAuthorityKey(tm.authority.Public().(ed25519.PublicKey)), tm.certOf(n))
	} else {
		b.WriteString("trust:\n  nodes:\n")
		for _, other := range tm.order {
			fmt.Fprintf(&b, "    - {name: %s, public_key: %q}\n", other, tm.nodes[other].pub)
		}
	}
	// connect_timeout bounds a QUIC handshake too: 5s, as a loaded machine
	// under -race can take over a second for one (a dead peer is found by
	// the transport's short idle timeout, not by this bound).
	fmt.Fprintf(&b, "proxy: {%sconnect_timeout: 5s, health_interval: 100ms, shutdown_timeout: %s}\n", tm.proxyYAML[name], cmp.Or(tm.shutdown, 2*time.Second))
	b.WriteString(tm.extraYAML[name])
	b.WriteString("roles:\n")
	port := 20000
	for role, r := range roles {
		port++ // placeholder: replaced by 0 after loading (any free port)
		if tm.procs[name] {
			port = testnet.TCPPort(t, "127.0.0.1")
			if n.ports == nil {
				n.ports = map[string]int{}
			}
			n.ports[role] = port
		}
		fmt.Fprintf(&b, "  %s:\n    port: %d\n    expose: %v\n", role, port, r.expose)
		if r.upstream != nil {
			fmt.Fprintf(&b, "    upstream: %s\n    model: %s\n", r.upstream.base, r.model)
		}
		if r.keyFile != "" {
			fmt.Fprintf(&b, "    upstream_api_key_file: %s\n", r.keyFile)
		}
		if r.extra != "" {
			fmt.Fprintf(&b, "    %s\n", r.extra)
		}
		if !strings.Contains(r.extra, "routing:") {
			// The mesh tests state the seed's order (the local instance,
			// then peers by load, ties by node id): policy local-first. The
			// default, auto, would order equal peers by their measured
			// round trip, which a loaded host makes noise; a test of auto
			// sets routing in extra.
			b.WriteString("    routing: {policy: local-first}\n")
		}
		if len(r.serveTo) > 0 {
			fmt.Fprintf(&b, "    serve_to: [%s]\n", strings.Join(r.serveTo, ", "))
		}
		if len(r.acceptFrom) > 0 {
			fmt.Fprintf(&b, "    accept_from: [%s]\n", strings.Join(r.acceptFrom, ", "))
		}
	}
	n.cfgPath = filepath.Join(tm.root, name+".yaml")
	if err := os.WriteFile(n.cfgPath, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if tm.procs[name] {
		return tm.startProc(n)
	}
	cfg, err := LoadConfig(n.cfgPath)
	if err != nil {
		t.Fatalf("%s: %v\n%s", name, err, b.String())
	}
	for role, r := range cfg.Roles {
		r.Port = 0 // any free loopback port; RoleAddr tells which
		cfg.Roles[role] = r
	}
	if tm.shared[name] {
		cfg.Proxy.Listen = n.ip + ":0"
	}
	var notify func(string)
	if tm.notify != nil {
		notify = func(state string) { tm.notify(name, state) }
	}
	a, err := New(cfg, Options{
		Logger: tm.loggers[name],
		Notify: notify,
		MeshTuning: func(c *mesh.Config) {
			c.GossipInterval = 20 * time.Millisecond
			c.ProbeInterval = 100 * time.Millisecond
			c.ProbeTimeout = 50 * time.Millisecond
			c.SuspicionMult = 2
			c.RetransmitMult = 3
			c.TCPTimeout = time.Second
			c.JoinBackoff = 20 * time.Millisecond
			c.JoinMaxBackoff = 100 * time.Millisecond
			c.RejoinInterval = 100 * time.Millisecond
			c.RejoinMaxBackoff = 400 * time.Millisecond
			if tm.meshTuning != nil {
				tm.meshTuning(name, c)
			}
		},
		TransportTuning: func(c *mesh.TransportConfig) {
			if !tm.quicDefaults {
				c.KeepAlivePeriod = 100 * time.Millisecond
				c.MaxIdleTimeout = time.Second
			}
			c.RecheckInterval = 50 * time.Millisecond
			c.PacketConn = quicPC
			if tm.transportTuning != nil {
				tm.transportTuning(name, c)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	n.agent, n.stopped = a, false
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel, n.done = cancel, make(chan error, 1)
	go func() { n.done <- a.Run(ctx) }()
	t.Cleanup(func() { tm.stop(name) })
	waitFor(t, name+" listening", func() bool {
		for role := range roles {
			if _, ok := a.RoleAddr(role); !ok {
				return false
			}
		}
		return a.Transport() != nil
	})
	return n
}

// keyringOf is n's keyring file: the shared one, or with ownKeyrings n's
// own copy of it, made at its first start.
func (tm *testMesh) keyringOf(n *meshNode) string {
	if !tm.ownKeyrings {
		return tm.keyring
	}
	own := filepath.Join(n.stateDir, "keyring.json")
	if _, err := os.Stat(own); err == nil {
		return own
	}
	data, err := os.ReadFile(tm.keyring)
	if err == nil {
		err = os.WriteFile(own, data, 0o600)
	}
	if err != nil {
		tm.t.Fatal(err)
	}
	return own
}

// certOf is n's full-scope admission certificate from tm.authority.
func (tm *testMesh) certOf(n *meshNode) string {
	pub, err := identity.ParsePublicKey(n.pub)
	if err == nil {
		var c *identity.Certificate
		if c, err = identity.IssueCertificate(tm.authority, n.name, pub, identity.ScopeFull, time.Hour, time.Now()); err == nil {
			return c.String()
		}
	}
	tm.t.Fatal(err)
	return ""
}

// admitEachOther waits until the running nodes admit one another: a node
// that hears a peer's advert before that peer admits it is refused by it
// (not admitted), which most tests are not about.
func (tm *testMesh) admitEachOther(names ...string) {
	tm.t.Helper()
	for _, x := range names {
		for _, y := range names {
			if x == y {
				continue
			}
			waitFor(tm.t, x+" admits "+y, func() bool {
				m := tm.nodes[x].agent.Mesh()
				return m != nil && m.IsAdmitted(y)
			})
		}
	}
}

// stop stops name's agent (gracefully) once.
func (tm *testMesh) stop(name string) {
	n := tm.nodes[name]
	if n.stopped || n.cancel == nil {
		return
	}
	n.stopped = true
	n.cancel()
	if err := <-n.done; err != nil {
		tm.t.Errorf("%s: Run: %v", name, err)
	}
}

// kill makes name unreachable over QUIC at once, without a word to its
// peers: its socket is closed under the transport, as when the process dies.
func (tm *testMesh) kill(name string) {
	n := tm.nodes[name]
	if n.pc == nil {
		tm.t.Fatalf("%s: the test does not own its socket", name)
	}
	n.pc.Close()
}

func (n *meshNode) url(role string) string {
	addr, _ := n.agent.RoleAddr(role)
	return "http://" + addr.String()
}

func (n *meshNode) resolvesTo(role string, nodes ...string) bool {
	var got []string
	for _, c := range n.agent.Table().Resolve(role) {
		if c.Kind == placement.KindRemote {
			got = append(got, c.Node)
		}
	}
	slices.Sort(got)
	return slices.Equal(got, nodes)
}

func (n *meshNode) audited(kind, why string) bool {
	return slices.ContainsFunc(n.agent.Audit().Recent(), func(e Event) bool {
		return e.Kind == kind && (why == "" || e.Fields["why"] == why)
	})
}

// sendDirect sends a chat request for role straight through n's QUIC
// transport to peer, bypassing n's placement.
func (n *meshNode) sendDirect(t *testing.T, peer, role string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+peer+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+role+`","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set(proxy.RoleHeader, role)
	resp, err := n.agent.Transport().RoundTrip(req)
	if err != nil {
		t.Fatalf("%s -> %s: %v", n.name, peer, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func sdkClient(base string) openai.Client {
	return openai.NewClient(option.WithBaseURL(base+"/v1"), option.WithAPIKey("sk-local"), option.WithMaxRetries(0))
}

func chatReq(model string) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:     openai.ChatModel(model),
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello over the mesh")},
		MaxTokens: openai.Int(8),
	}
}

func TestRemoteRoleServedByPeerWithSDK(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	ub := startUpstream(t, "model-b", 0)
	// Every QUIC socket here comes from the config files (mesh.quic).
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"other": {}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	tm.admitEachOther("a", "b")

	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, model := range []string{"chat", "model-b"} {
		t.Run("complete/"+model, func(t *testing.T) {
			resp, err := c.Chat.Completions.New(ctx, chatReq(model))
			if err != nil {
				t.Fatal(err)
			}
			if resp.Model != model {
				t.Errorf("response model = %q, want the one asked for, %q", resp.Model, model)
			}
			if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
				t.Errorf("choices = %+v, want one with content", resp.Choices)
			}
		})
		t.Run("stream/"+model, func(t *testing.T) {
			stream := c.Chat.Completions.NewStreaming(ctx, chatReq(model))
			var chunks int
			var text strings.Builder
			for stream.Next() {
				ch := stream.Current()
				chunks++
				if ch.Model != model {
					t.Errorf("chunk %d model = %q, want %q", chunks, ch.Model, model)
				}
				for _, choice := range ch.Choices {
					text.WriteString(choice.Delta.Content)
				}
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream: %v", err)
			}
			if chunks < 2 || text.Len() == 0 {
				t.Errorf("got %d chunks, %d bytes of text; want a streamed answer", chunks, text.Len())
			}
		})
	}
	if got := ub.requests.Load(); got != 4 {
		t.Errorf("b's instance served %d requests, want 4", got)
	}
	for _, m := range ub.seenModels() {
		if m != "model-b" {
			t.Errorf("b's instance was asked for model %q, want it pinned to model-b", m)
		}
	}
}

func TestRemoteRefusals(t *testing.T) {
	type setup struct {
		aAccepts []string
		bExpose  bool
		bServeTo []string
	}
	tests := []struct {
		name string
		s    setup
		// aResolves: whether a's placement offers b at all.
		aResolves bool
		// status of a's loopback answer; b's refusal audit reason (when b is asked).
		wantStatus int
		bWhy       placement.Reason
		aWhy       placement.Reason
	}{
		{"a has not allowed b", setup{aAccepts: nil, bExpose: true, bServeTo: []string{"a"}}, false,
			http.StatusServiceUnavailable, "", placement.ReasonNotAllowlisted},
		// b's refusal is a failure before the first byte: with no other
		// candidate, a answers that nothing serves the role to it.
		{"b does not serve the role to a", setup{aAccepts: []string{"b"}, bExpose: true, bServeTo: []string{"c"}}, true,
			http.StatusServiceUnavailable, placement.ReasonNotOnServeList, ""},
		{"b does not expose the role", setup{aAccepts: []string{"b"}, bExpose: false}, false,
			http.StatusServiceUnavailable, placement.ReasonNotExposed, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tm := newTestMesh(t, "a", "b", "c")
			ub := startUpstream(t, "model-b", 0)
			a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: tt.s.aAccepts}}, false)
			b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: tt.s.bExpose, serveTo: tt.s.bServeTo}}, false)
			tm.start("c", map[string]roleSpec{"other": {}}, false)
			waitFor(t, "everyone sees everyone", func() bool {
				m := a.agent.Mesh()
				return m.IsAdmitted("b") && m.IsAdmitted("c") && b.agent.Mesh().IsAdmitted("a")
			})
			waitFor(t, "b's instance is up", func() bool { return len(b.agent.Table().Resolve("chat")) > 0 })
			if tt.aResolves {
				waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
			} else if tt.aWhy != "" {
				waitFor(t, "a refuses b's advert", func() bool { return a.audited(placement.AuditAdvertRefused, string(tt.aWhy)) })
			} else {
				// b never advertises: wait until its advertiser has
				// passed over its roles a few times.
				rounds := b.agent.Mesh().GossipStats().AdvertRounds
				waitFor(t, "b's advertiser runs", func() bool { return b.agent.Mesh().GossipStats().AdvertRounds >= rounds+3 })
			}
			if !tt.aResolves && !a.resolvesTo("chat") {
				t.Fatalf("a resolves chat to a remote, want none")
			}

			resp, err := http.Post(a.url("chat")+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.wantStatus {
				t.Errorf("a answered %d %s, want %d", resp.StatusCode, body, tt.wantStatus)
			}
			var apiErr struct {
				Error struct{ Type, Code, Message string }
			}
			if err := json.Unmarshal(body, &apiErr); err != nil || apiErr.Error.Code == "" {
				t.Errorf("a's answer %s is not an OpenAI-shaped error", body)
			}

			if tt.bWhy != "" {
				// Asked directly, b refuses the same way whether the role is
				// withheld from a or does not exist: a learns nothing.
				st, got := a.sendDirect(t, "b", "chat")
				stNone, none := a.sendDirect(t, "b", "nosuchrole")
				if st != http.StatusNotFound || st != stNone || got != strings.ReplaceAll(none, "nosuchrole", "chat") {
					t.Errorf("b refused chat with %d %s and a missing role with %d %s; want the same 404", st, got, stNone, none)
				}
				waitFor(t, "b audits the refusal", func() bool { return b.audited(placement.AuditPeerRefused, string(tt.bWhy)) })
			}
			if got := ub.requests.Load(); got != 0 {
				t.Errorf("b's instance served %d requests, want 0", got)
			}
		})
	}
}

func TestRemoteHandshakeRefusesUnknownClients(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.start("a", map[string]roleSpec{"other": {}}, false)
	ub := startUpstream(t, "model-b", 0)
	b := tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a", "mallory"}}}, false)
	// "a with another key" is a key mismatch only once b knows a's key.
	waitFor(t, "b admits a", func() bool { return b.agent.Mesh().IsAdmitted("a") })

	_, stranger, _ := ed25519.GenerateKey(nil)
	tests := []struct {
		name  string
		certs func(t *testing.T) []tls.Certificate
		why   string
	}{
		{"no certificate", func(*testing.T) []tls.Certificate { return nil }, mesh.RefusedNoCertificate},
		{"certificate of an unadmitted key", func(t *testing.T) []tls.Certificate {
			return []tls.Certificate{selfSigned(t, "mallory", stranger)}
		}, mesh.RefusedNotAdmitted},
		{"an admitted name with another key", func(t *testing.T) []tls.Certificate {
			return []tls.Certificate{selfSigned(t, "a", stranger)}
		}, mesh.RefusedKeyMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			tc := &tls.Config{Certificates: tt.certs(t), InsecureSkipVerify: true, NextProtos: []string{http3.NextProtoH3}}
			conn, err := quic.DialAddr(ctx, b.quic, tc, nil)
			if err == nil {
				// TLS 1.3 clients finish before the server checked them: the
				// refusal closes the connection before any request is served.
				cc := (&http3.Transport{}).NewClientConn(conn)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://b/v1/chat/completions", strings.NewReader(`{}`))
				req.Header.Set(proxy.RoleHeader, "chat")
				if resp, err := cc.RoundTrip(req); err == nil {
					resp.Body.Close()
					t.Errorf("a refused client got status %d", resp.StatusCode)
				}
				conn.CloseWithError(0, "")
			}
			waitFor(t, "b audits the refused handshake", func() bool { return b.audited(mesh.AuditQUICRefused, tt.why) })
		})
	}
	// Handshake refusals reach the metrics (infermesh_mesh_refusals_total).
	if got := (meshStats{m: b.agent.Mesh(), tr: b.agent.Transport}).Refusals()["quic_"+mesh.RefusedNoCertificate]; got == 0 {
		t.Errorf("quic_%s refusals = 0 in the metrics' source, want counted", mesh.RefusedNoCertificate)
	}
	if got := ub.requests.Load(); got != 0 {
		t.Errorf("b's instance served %d requests, want 0", got)
	}
}

// selfSigned is a certificate like a node's, for any name and key.
func selfSigned(t *testing.T, name string, key ed25519.PrivateKey) tls.Certificate {
	t.Helper()
	c, err := mesh.NodeCertificate(name, key)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestRemoteFailoverWhenPeerKilled(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	ub := startUpstream(t, "model-b", 0)
	uc := startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, true)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })

	c := sdkClient(a.url("chat"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Chat.Completions.New(ctx, chatReq("chat")); err != nil {
		t.Fatal(err)
	}
	if ub.requests.Load() != 1 {
		t.Fatalf("before the kill: b served %d, c %d; want b first (equal load, placement's order)", ub.requests.Load(), uc.requests.Load())
	}

	// b dies: its gossip still says it is alive for a moment, but nothing
	// answers over QUIC. Every new request must still be answered, by c.
	tm.kill("b")
	const n = 6
	for i := range n {
		resp, err := c.Chat.Completions.New(ctx, chatReq("chat"))
		if err != nil {
			t.Fatalf("request %d after b died: %v", i, err)
		}
		if resp.Model != "chat" {
			t.Errorf("request %d: model %q, want chat", i, resp.Model)
		}
	}
	if got := uc.requests.Load(); got != n {
		t.Errorf("c served %d requests after b died, want %d", got, n)
	}
	if got := ub.requests.Load(); got != 1 {
		t.Errorf("b served %d requests, want only the one before it died", got)
	}
	// a saw b fail: at equal advertised load c is now tried first, so later
	// requests do not wait on b at all.
	scores := a.agent.PeerScores()
	i := slices.IndexFunc(scores, func(p proxy.PeerScore) bool { return p.Node == "b" })
	if i < 0 || scores[i].Failures < 1 {
		t.Errorf("a's view of its peers = %+v, want b's failure counted", scores)
	}
	if order := a.agent.scorer.Resolve("chat"); len(order) == 2 && order[0].Node != "c" {
		t.Errorf("a's order for chat = %+v, want c first after b failed", order)
	}
}

func TestRemotePeerKilledMidStreamAborts(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 20*time.Millisecond)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, true)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions",
		strings.NewReader(`{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	events := 0
	var readErr error
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			readErr = err
			break
		}
		if strings.HasPrefix(line, "data: [DONE]") {
			t.Fatal("the stream ended as if complete")
		}
		if strings.HasPrefix(line, "data: ") {
			events++
			if events == 3 {
				tm.kill("b")
			}
		}
	}
	if ctx.Err() != nil {
		t.Fatal("the stream was still open at the test's deadline")
	}
	if readErr == io.EOF {
		t.Errorf("the stream ended with a clean EOF after %d events; want it aborted", events)
	}
	if events < 3 {
		t.Errorf("got %d events before the error, want at least 3", events)
	}
}

func TestRemoteClientCancelReachesPeerUpstream(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 20*time.Millisecond)
	a, _ := tm.chatFromB(ub)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := sdkClient(a.url("chat"))
	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:    "chat",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("a long answer please")},
	})
	if !stream.Next() {
		t.Fatalf("no first chunk: %v", stream.Err())
	}
	cancel()
	for stream.Next() {
	}
	waitFor(t, "b's instance sees its request context end", func() bool { return ub.cancelled.Load() == 1 })
	if st := ub.demo.Stats(); st.StreamsCompleted != 0 {
		t.Errorf("b's instance completed %d streams, want 0 (cancelled)", st.StreamsCompleted)
	}
}

func TestRemoteRequestNeverBounces(t *testing.T) {
	tm := newTestMesh(t, "a", "b", "c")
	uc := startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	// b has no instance of its own but may use c's: it must not forward a's
	// request there.
	b := tm.start("b", map[string]roleSpec{"chat": {expose: true, serveTo: []string{"a"}, acceptFrom: []string{"c"}}}, false)
	c := tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a", "b"}}}, false)
	waitFor(t, "b resolves chat to c", func() bool { return b.resolvesTo("chat", "c") })
	waitFor(t, "a admits b", func() bool { return a.agent.Mesh().IsAdmitted("b") })
	// c serves b only once it has heard b (gossip), whatever b has heard
	// of c: b's own request below would be refused before that.
	waitFor(t, "c admits b", func() bool { return c.agent.Mesh().IsAdmitted("b") })

	st, body := a.sendDirect(t, "b", "chat")
	if st != http.StatusNotFound {
		t.Errorf("b answered a's request with %d %s, want 404", st, body)
	}
	waitFor(t, "b audits the refusal", func() bool { return b.audited(placement.AuditPeerRefused, string(placement.ReasonNoLocal)) })
	if got := uc.requests.Load(); got != 0 {
		t.Errorf("c's instance served %d requests: a's request bounced through b", got)
	}
	// b itself does reach c: the refusal above is not for lack of a route.
	resp, err := http.Post(b.url("chat")+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	rb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || uc.requests.Load() != 1 {
		t.Errorf("b's own request: status %d %s, c served %d; want 200 and 1", resp.StatusCode, rb, uc.requests.Load())
	}
}

// TestRouteHintsANearRoleName: a asks for chat, b advertises chats (a typo
// on one side). route chat on a names b's role as the one probably meant,
// and an unknown role's not-found error does too.
func TestRouteHintsANearRoleName(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chats": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a refuses b's advert of chats", func() bool {
		return slices.ContainsFunc(a.agent.Audit().Recent(), func(e Event) bool {
			return e.Kind == placement.AuditAdvertRefused && e.Role == "chats" && e.Node == "b"
		})
	})
	a.agent.mu.Lock()
	be := a.agent.admin.Backend()
	a.agent.mu.Unlock()
	rt, err := be.Route(context.Background(), "chat")
	if err != nil {
		t.Fatal(err)
	}
	if want := `role "chats" is advertised by b: did you mean it?`; !slices.Contains(rt.Hints, want) {
		t.Errorf("route chat hints = %q, want %q", rt.Hints, want)
	}
	if _, err := be.Route(context.Background(), "chatz"); err == nil || !strings.Contains(err.Error(), `role "chats" is advertised by b`) {
		t.Errorf("route chatz = %v, want not found with the hint", err)
	}
	if _, err := be.Route(context.Background(), "chats"); err == nil || strings.Contains(err.Error(), "did you mean") {
		t.Errorf("route chats = %v; want not found, with no hint for the name itself", err)
	}
}

// TestRequestIDAndServedByAcrossTheMesh: a request served by a peer keeps
// one id on both hops (the app's, or the one a makes), and the response
// names the peer that served it.
func TestRequestIDAndServedByAcrossTheMesh(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 0)
	a, _ := tm.chatFromB(ub)
	for i, sent := range []string{"app-trace-42", ""} {
		req, _ := http.NewRequest(http.MethodPost, a.url("chat")+"/v1/chat/completions",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
		if sent != "" {
			req.Header.Set(proxy.RequestIDHeader, sent)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		id := resp.Header.Get(proxy.RequestIDHeader)
		ub.mu.Lock()
		seen := ub.ids[i]
		ub.mu.Unlock()
		if resp.StatusCode != 200 || id == "" || id != seen || (sent != "" && id != sent) {
			t.Errorf("request %d: status %d, response id %q, b's instance saw %q, app sent %q", i, resp.StatusCode, id, seen, sent)
		}
		if by := resp.Header.Get(proxy.ServedByHeader); by != "b" {
			t.Errorf("request %d: %s = %q, want b", i, proxy.ServedByHeader, by)
		}
	}
}

// TestSharedPortAcrossTheMesh: a's shared port lists what a can reach now
// (its own role and b's, within the allowlists), and routes a request for
// b's model to b.
func TestSharedPortAcrossTheMesh(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	tm.shared = map[string]bool{"a": true}
	ua := startUpstream(t, "model-a", 0)
	ub := startUpstream(t, "model-b", 0)
	a := tm.start("a", map[string]roleSpec{
		"embed": {upstream: ua, model: "model-a"},
		"chat":  {acceptFrom: []string{"b"}},
	}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	waitFor(t, "a's embed instance is up", func() bool { return len(a.agent.Table().Resolve("embed")) > 0 })
	addr, ok := a.agent.SharedAddr()
	if !ok {
		t.Fatal("no shared port")
	}
	base := "http://" + addr.String()
	resp, err := http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct{ Data []struct{ ID string } }
	_ = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if got, want := strings.Join(ids, ","), "chat,model-b,embed,model-a"; got != want {
		t.Errorf("shared /v1/models = %s, want %s", got, want)
	}
	c := sdkClient(base)
	for model, up := range map[string]*testUpstream{"model-b": ub, "chat": ub, "model-a": ua, "embed": ua} {
		before := up.requests.Load()
		r, err := c.Chat.Completions.New(context.Background(), chatReq(model))
		if err != nil {
			t.Fatalf("model %s: %v", model, err)
		}
		if r.Model != model || up.requests.Load() != before+1 {
			t.Errorf("model %s: answered as %q, its instance served %d new requests; want it routed there", model, r.Model, up.requests.Load()-before)
		}
	}
}

// The instance behind a remote role sees the app's User-Agent, and none
// when the app sent none, as behind a local role: the hop adds none of
// its own (quic-go's HTTP/3 client would add "quic-go HTTP/3").
func TestRemoteHopForwardsTheAppsUserAgentOnly(t *testing.T) {
	tm := newTestMesh(t, "a", "b")
	ub := startUpstream(t, "model-b", 0)
	a, _ := tm.chatFromB(ub)
	client := &http.Client{Timeout: 10 * time.Second}
	for _, ua := range []string{"", "app/1.0"} {
		req, err := http.NewRequest(http.MethodPost, a.url("chat")+"/v1/chat/completions",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header["User-Agent"] = []string{ua} // "": net/http sends none
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("User-Agent %q: status %d", ua, resp.StatusCode)
		}
	}
	if got, want := ub.seenAgents(), []string{"", "app/1.0"}; !slices.Equal(got, want) {
		t.Errorf("b's instance saw User-Agents %q, want %q", got, want)
	}
}

// chatFromB starts the pair most remote tests need: b serves chat (model
// model-b, from up) and exposes it to a, which accepts chat from b. It
// returns once a resolves chat to b.
func (tm *testMesh) chatFromB(up *testUpstream) (a, b *meshNode) {
	tm.t.Helper()
	a = tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	b = tm.start("b", map[string]roleSpec{"chat": {upstream: up, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(tm.t, "a resolves chat to b", func() bool { return a.resolvesTo("chat", "b") })
	return a, b
}
