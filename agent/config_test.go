package agent

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/config"

	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/provision"
)

const fullConfig = `
node: { name: a, state_dir: /tmp/im-a }
site: lab
log: { level: debug, format: console }
mesh:
  bind: 127.0.0.1:7946
  quic: 127.0.0.1:7947
  join: [127.0.0.2:7946]
trust:
  nodes: [{name: b, public_key: c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8=}]
admin: { socket: /tmp/im-a/admin.sock, group: infermesh-admin }
roles:
  chat:
    port: 18080
    upstream: http://127.0.0.1:8081/
    model: llama-3-8b
    expose: true
    serve_to: [b]
    accept_from: [b, c]
  embed:
    port: 18081
    instance:
      image: llama-server:local
      args: ["--port", "8080"]
      port: 8080
      mounts: [{host: /models/e5.gguf, container: /models/e5.gguf, readonly: true}]
      restart: { max: 3, backoff: 1s }
`

func TestParseConfigFull(t *testing.T) {
	cfg, err := ParseConfig([]byte(fullConfig))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := cfg.Node.Name, "a"; got != want {
		t.Errorf("node.name = %q, want %q", got, want)
	}
	if got, want := cfg.Mesh.Cluster, DefaultCluster; got != want {
		t.Errorf("mesh.cluster = %q, want default %q", got, want)
	}
	if got, want := cfg.Trust.Nodes[0].Scope, "full"; got != want {
		t.Errorf("trust.nodes[0].scope = %q, want %q", got, want)
	}
	in := cfg.Roles["embed"].Instance
	if in.Runtime != "docker" || in.Health != "/health" || in.Restart.Max != 3 || in.Restart.Backoff != time.Second || in.Restart.Window != 10*time.Minute {
		t.Errorf("instance defaults = %+v", in)
	}
	if !in.Mounts[0].ReadOnly {
		t.Error("readonly mount lost")
	}
	if cfg.Proxy.ShutdownTimeout != defaultShutdown || cfg.Proxy.HealthInterval != defaultHealthPeriod {
		t.Errorf("proxy defaults = %+v", cfg.Proxy)
	}
}

func TestParseConfigRuntimes(t *testing.T) {
	cfg, err := ParseConfig([]byte(`
node: {name: a, cache_dir: /srv/cache}
roles:
  chat: {port: 1, model: m, instance: {runtime: native, command: /usr/bin/llama-server, args: [--port, "8080"], env: {A: b}, port: 8080}}
  demo: {port: 2, model: d, instance: {runtime: simulated}}
  embed: {port: 3, instance: {image: x, port: 8080}}
`))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Node.CacheDir != "/srv/cache" {
		t.Errorf("node.cache_dir = %q", cfg.Node.CacheDir)
	}
	if in := cfg.Roles["chat"].Instance; in.Health != "/health" || in.Restart.Max != 5 {
		t.Errorf("native defaults = %+v", in)
	}
	desired := cfg.desiredInstances()
	if len(desired) != 2 || desired["chat"].Command != "/usr/bin/llama-server" || desired["chat"].Runtime != "native" || desired["embed"].Runtime != "docker" {
		t.Errorf("desired instances = %+v, want chat (native) and embed (docker); a simulated one is served by the agent", desired)
	}
	if got := cfg.boundKinds().Kinds(); len(got) != 3 {
		t.Errorf("bound kinds = %v, want docker, native, simulated", got)
	}
}

func TestParseConfigEmptyIsValid(t *testing.T) {
	cfg, err := ParseConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Node.StateDir != config.DefaultStateDir || cfg.Node.CacheDir != config.DefaultCacheDir || cfg.Admin.Socket != config.DefaultAdminSocket || cfg.Site != config.DefaultSite {
		t.Errorf("defaults = %+v", cfg)
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name, yaml, want string
	}{
		{"unknown top key", "node: {name: a}\nbogus: 1\n", `line 2: unknown key "bogus"`},
		{"unknown nested key", "node: {name: a}\nroles:\n  chat:\n    port: 1\n    upstreem: x\n", `line 5: unknown key "upstreem"`},
		{"unknown key path and hint", "node: {name: a}\nroles:\n  chat:\n    port: 1\n    upstreem: x\n", `unknown key "upstreem" (roles.chat.upstreem); did you mean "upstream"?`},
		{"dash for underscore", "node: {name: a}\nroles:\n  chat: {port: 1, serve-to: [b]}\n", `(roles.chat.serve-to); did you mean "serve_to"?`},
		{"unknown key in a list item", "node: {name: a}\ntrust: {nodes: [{name: b, pubkey: k}]}\n", `unknown key "pubkey" (trust.nodes[0].pubkey)`},
		{"every unknown key at once", "nodee: {name: a}\nbogus: 1\n", `line 1: unknown key "nodee" (nodee); did you mean "node"?; line 2: unknown key "bogus" (bogus)`},
		{"duration without unit", "node: {name: a}\nproxy: {connect_timeout: 5}\n", "line 2: proxy.connect_timeout: 5 has no unit; write 5s"},
		{"nested duration without unit", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, restart: {backoff: 2}}}\n", "roles.c.instance.restart.backoff: 2 has no unit"},
		{"role port required", "node: {name: a}\nroles:\n  chat: {upstream: 'http://127.0.0.1:80'}\n", "roles.chat.port: is required"},
		{"instance port required", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {image: x}}\n", "roles.chat.instance.port: is required"},
		{"shared port off loopback", "node: {name: a}\nproxy: {listen: '0.0.0.0:8080'}\n", "proxy.listen"},
		{"shared port is a role port", "node: {name: a}\nproxy: {listen: '127.0.0.1:8080'}\nroles:\n  chat: {port: 8080}\n", "roles.chat.port: 8080 is already used by proxy.listen"},
		{"bad gpus", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, gpus: some}}\n", `roles.c.instance.gpus: "some" is not all, a count or a list of device ids`},
		{"zero gpus", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, gpus: 0}}\n", `gpus: "0"`},
		{"bad size", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, shm_size: lots}}\n", `"lots" is not a size`},
		{"native with gpus", "node: {name: a}\nroles:\n  c: {port: 1, instance: {runtime: native, command: /bin/x, port: 1, gpus: all}}\n", "roles.c.instance.gpus: is not used by runtime native"},
		{"negative cpus", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, cpus: -1}}\n", "roles.c.instance.cpus"},
		{"negative startup timeout", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, startup_timeout: -1s}}\n", "roles.c.instance.startup_timeout"},
		{"bad role name", "node: {name: a}\nroles:\n  'a/b': {port: 1}\n", "roles.a/b"},
		{"port range", "node: {name: a}\nroles:\n  chat: {port: 70000}\n", "roles.chat.port"},
		{"duplicate port", "node: {name: a}\nroles:\n  a: {port: 5}\n  b: {port: 5}\n", `roles.b.port: 5 is already used by role "a"`},
		{"non-loopback upstream", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://10.0.0.1:80'}\n", "roles.chat.upstream"},
		{"upstream with path", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:80/v1'}\n", "roles.chat.upstream"},
		{"https upstream", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'https://127.0.0.1:80'}\n", "roles.chat.upstream"},
		{"both upstream and instance", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:80', instance: {image: x, port: 1}}\n", "roles.chat: set either"},
		{"instance without image", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {port: 1}}\n", "roles.chat.instance.image"},
		{"relative mount", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {image: x, port: 1, mounts: [{host: m, container: /m}]}}\n", "roles.chat.instance.mounts[0].host"},
		{"serve_to without expose", "node: {name: a}\nroles:\n  chat: {port: 1, serve_to: [b]}\n", "roles.chat.serve_to"},
		{"bad peer name", "node: {name: a}\nroles:\n  chat: {port: 1, accept_from: ['x y']}\n", "roles.chat.accept_from[0]"},
		{"bad metrics mode", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', metrics: sglang}\n", "roles.chat.metrics"},
		{"bad instance metrics mode", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: simulated, metrics: x}}\n", "roles.chat.instance.metrics"},
		{"negative capacity", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', capacity: -1}\n", "roles.chat.capacity"},
		{"unknown routing policy", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', routing: {policy: nearest}}\n", "roles.chat.routing.policy"},
		{"negative queue", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', routing: {queue: {max: -1}}}\n", "roles.chat.routing.queue.max"},
		{"queue timeout without max", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', routing: {queue: {timeout: 5s}}}\n", "roles.chat.routing.queue.timeout"},
		{"relative margin below 1", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', routing: {margin: {relative: 0.5}}}\n", "roles.chat.routing.margin.relative"},
		{"unknown affinity", "node: {name: a}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:8081', routing: {affinity: sticky}}\n", "roles.chat.routing.affinity"},
		{"console off loopback", "node: {name: a}\nadmin: {console: '0.0.0.0:8099'}\n", "admin.console"},
		{"bad otlp endpoint", "node: {name: a}\ntelemetry: {otlp_endpoint: 'localhost:4318'}\n", "telemetry.otlp_endpoint"},
		{"bad sample", "node: {name: a}\ntelemetry: {sample: 2}\n", "telemetry.sample"},
		{"bad log level", "node: {name: a}\nlog: {level: loud}\n", "log.level"},
		{"unknown proxy server", "node: {name: a}\nproxy: {server: nginx}\n", `proxy.server: "nginx" is not infermesh or std`},
		{"negative max_conns", "node: {name: a}\nproxy: {max_conns: -1}\n", "proxy.max_conns"},
		{"body memory below the body limit", "node: {name: a}\nproxy: {max_body_memory: 1048576}\n", "proxy.max_body_memory: 1048576 is below max_body_bytes"},
		{"negative write timeout", "node: {name: a}\nproxy: {write_timeout: -1s}\n", "proxy.write_timeout"},
		{"negative peer first byte timeout", "node: {name: a}\nproxy: {peer_first_byte_timeout: -1s}\n", "proxy.peer_first_byte_timeout"},
		{"bad duration", "node: {name: a}\nproxy: {connect_timeout: soon}\n", "line 2"},
		{"mesh without quic", "node: {name: a}\nmesh: {bind: '127.0.0.1:7946'}\n", "mesh.quic"},
		{"join without bind", "node: {name: a}\nmesh: {join: ['127.0.0.1:1']}\n", "mesh.bind"},
		{"quic port 0", "node: {name: a}\nmesh: {bind: '127.0.0.1:1', quic: '127.0.0.1:0'}\n", "mesh.quic"},
		{"quic wildcard", "node: {name: a}\nmesh: {bind: '127.0.0.1:1', quic: '0.0.0.0:7947'}\n", "set mesh.quic_advertise"},
		{"quic advertise wildcard", "node: {name: a}\nmesh: {bind: '127.0.0.1:1', quic: '0.0.0.0:7947', quic_advertise: ':7947'}\n", "mesh.quic_advertise"},
		{"bad join", "node: {name: a}\nmesh: {bind: '127.0.0.1:1', quic: '127.0.0.1:2', join: [nope]}\n", "mesh.join[0]"},
		{"negative max_conns_per_peer", "node: {name: a}\nmesh: {bind: '127.0.0.1:1', quic: '127.0.0.1:2', max_conns_per_peer: -1}\n", "mesh.max_conns_per_peer: -1 is negative"},
		{"trusted node bad key", "node: {name: a}\ntrust: {nodes: [{name: b, public_key: nope}]}\n", "trust.nodes[0].public_key"},
		{"bad authority", "node: {name: a}\ntrust: {authority: 'AAAA'}\n", "trust.authority"},
		{"node key as authority", "node: {name: a}\ntrust: {authority: 'nodekey:c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8='}\n", "trust.authority: authority key: nodekey:... is a node key, not an authority key"},
		{"authority key as a node's", "node: {name: a}\ntrust: {nodes: [{name: b, public_key: 'authkey:c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8='}]}\n", "trust.nodes[0].public_key: node key: authkey:... is an authority key, not a node key"},
		{"trusted node without key", "node: {name: a}\ntrust: {nodes: [{name: b}]}\n", "trust.nodes[0].public_key"},
		{"bad scope", "node: {name: a}\ntrust: {nodes: [{name: b, public_key: k, scope: admin}]}\n", "trust.nodes[0].scope"},
		{"non-loopback metrics", "node: {name: a}\nadmin: {metrics: '0.0.0.0:9090'}\n", "set admin.metrics_allow_remote: true"},
		{"remote metrics not host:port", "node: {name: a}\nadmin: {metrics: 'nope', metrics_allow_remote: true}\n", "admin.metrics"},
		{"bad node name", "node: {name: '-x'}\n", "node.name"},
		{"not yaml", "node: [\n", "not valid YAML"},
		{"unknown runtime", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: futureRuntime, image: x, port: 1}}\n", `roles.chat.instance.runtime: "futureRuntime" is not docker, native or simulated`},
		{"native without command", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: native, port: 1}}\n", "roles.chat.instance.command: is required"},
		{"native relative command", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: native, command: llama-server, port: 1}}\n", "roles.chat.instance.command"},
		{"native with image", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: native, command: /bin/x, image: y, port: 1}}\n", "roles.chat.instance.image: is not used by runtime native"},
		{"native with mounts", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: native, command: /bin/x, port: 1, mounts: [{host: /a, container: /b}]}}\n", "roles.chat.instance.mounts"},
		{"native without port", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: native, command: /bin/x}}\n", "roles.chat.instance.port"},
		{"docker with command", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {image: x, command: /bin/x, port: 1}}\n", "roles.chat.instance.command: is not used by runtime docker"},
		{"simulated with a port", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: simulated, port: 8080}}\n", "roles.chat.instance.port: is not used by runtime simulated"},
		{"simulated with args", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {runtime: simulated, args: [x]}}\n", "roles.chat.instance.args"},
		{"relative cache dir", "node: {name: a, cache_dir: cache}\n", "node.cache_dir"},
		{"bad env name", "node: {name: a}\nroles:\n  chat: {port: 1, instance: {image: x, port: 1, env: {'A=B': c}}}\n", "roles.chat.instance.env"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.yaml))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ParseConfig error = %v, want it to mention %q", err, tt.want)
			}
		})
	}
}

// TestParseConfigErrorMessages: a bad config is refused with a message
// that names the line and the field by its full path, says what is wrong
// and what is wanted; the YAML library's own words never reach the
// operator without them. Each message is the exact one wanted.
func TestParseConfigErrorMessages(t *testing.T) {
	const head = "node: {name: a}\nroles:\n  chat:\n    port: 1\n"
	tests := []struct {
		name, yaml, want string
	}{
		// A value of the wrong type names the field, not a Go type.
		{"string for an integer", "node: {name: a}\nroles:\n  chat:\n    port: abc\n",
			`line 4: roles.chat.port: "abc" is not a whole number`},
		{"fraction for an integer", "node: {name: a}\nroles:\n  chat:\n    port: 28100.5\n",
			`line 4: roles.chat.port: 28100.5 is not a whole number`},
		{"exponent for an integer", "node: {name: a}\nroles:\n  chat: {port: 1e3}\n",
			`line 3: roles.chat.port: 1e3 has a fraction or an exponent; write the whole number 1000`},
		{"integer out of range", "node: {name: a}\nproxy: {max_body_bytes: 9223372036854775808}\n",
			`line 2: proxy.max_body_bytes: 9223372036854775808 is out of range`},
		{"quoted integer", "node: {name: a}\nroles:\n  chat:\n    port: '8080'\n",
			`line 4: roles.chat.port: "8080" is quoted, which makes it a string; write it without quotes`},
		{"string for a bool", head + "    expose: maybe\n",
			`line 5: roles.chat.expose: "maybe" is not true or false`},
		{"number for a bool", head + "    expose: 1\n",
			`line 5: roles.chat.expose: 1 is not true or false`},
		{"list for a string", head + "    model: [a, b]\n",
			`line 5: roles.chat.model: want a string, got a list`},
		{"scalar for a list", head + "    serve_to: b\n",
			`line 5: roles.chat.serve_to: want a list ([a, b] or one "- item" line each), got "b"`},
		{"scalar for a section", "node: a\n",
			`line 1: node: want a section of keys (key: value lines), got "a"`},
		{"list for the roles", "node: {name: a}\nroles: [chat]\n",
			`line 2: roles: want a mapping (name: value, ...), got a list`},
		{"string for a float", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, cpus: many}}\n",
			`line 3: roles.c.instance.cpus: "many" is not a number`},
		{"bad duration", "node: {name: a}\nproxy: {connect_timeout: soon}\n",
			`line 2: proxy.connect_timeout: "soon" is not a duration (e.g. 5s, 500ms, 2m)`},
		{"bad size", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, memory: lots}}\n",
			`line 3: roles.c.instance.memory: "lots" is not a size (e.g. 512m, 8g)`},
		{"bad gpu id", "node: {name: a}\nroles:\n  c: {port: 1, instance: {image: x, port: 1, gpus: [0, '']}}\n",
			`line 3: roles.c.instance.gpus: "" (item 1) is not a device id`},
		{"every type error at once", "node: {name: a}\nproxy: {max_conns: x, server: [a]}\n",
			`line 2: proxy.max_conns: "x" is not a whole number; line 2: proxy.server: want a string, got a list`},
		{"key given twice", head + "    port: 2\n",
			`line 5: roles.chat.port: set twice (first on line 4)`},
		{"role given twice", "node: {name: a}\nroles:\n  chat: {port: 1}\n  chat: {port: 2}\n",
			`line 4: roles.chat: set twice (first on line 3)`},

		// A syntax error names the line it is on, not where its block began.
		{"key indented too little", head + "   upstream: x\n",
			`line 5 ("   upstream: x"): not valid YAML: did not find expected key (check its indentation: a key lines up with the other keys of its section)`},
		{"key indented too far", head + "      upstream: x\n",
			`line 5 ("      upstream: x"): not valid YAML: mapping values are not allowed in this context (check its indentation: a key lines up with the other keys of its section)`},
		{"tab", head + "\tupstream: x\n",
			`line 5 ("\tupstream: x"): not valid YAML: found a tab character that violates indentation (indent with spaces, not tabs)`},
		{"unterminated quote", "node: {name: a}\nsite: 'lab\nroles: {}\n",
			`line 2 ("site: 'lab"): not valid YAML: found unexpected end of stream`},
		{"unterminated flow", "node: {name: a\nsite: lab\n",
			`line 1 ("node: {name: a"): not valid YAML: did not find expected ',' or '}'`},

		// An upstream that is not a URL says what is missing.
		{"upstream without a scheme", head + "    upstream: 127.0.0.1:8081\n",
			`roles.chat.upstream: "127.0.0.1:8081" has no scheme: write "http://127.0.0.1:8081"`},
		{"upstream name without a scheme", head + "    upstream: localhost:8081\n",
			`roles.chat.upstream: "localhost:8081" has no scheme: write "http://localhost:8081"`},
		{"upstream not a URL", head + "    upstream: 'http://127.0.0.1:80 80'\n",
			`roles.chat.upstream: "http://127.0.0.1:80 80" is not a URL: want http://<loopback address>:<port>, e.g. http://127.0.0.1:8081`},
		{"upstream nothing like a URL", head + "    upstream: llama\n",
			`roles.chat.upstream: "llama" is not a URL: want http://<loopback address>:<port>, e.g. http://127.0.0.1:8081`},
		{"upstream without a port", head + "    upstream: http://127.0.0.1\n",
			`roles.chat.upstream: "http://127.0.0.1" has no port: want http://<loopback address>:<port>, e.g. http://127.0.0.1:8081`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.yaml))
			if err == nil || err.Error() != tt.want {
				t.Errorf("ParseConfig(%q) error =\n  %v\nwant\n  %s", tt.yaml, err, tt.want)
			}
		})
	}
}

func TestFieldErrorIsTyped(t *testing.T) {
	_, err := ParseConfig([]byte("node: {name: a}\nroles:\n  chat: {port: 0}\n"))
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "roles.chat.port" {
		t.Errorf("err = %v, want *FieldError for roles.chat.port", err)
	}
}

func TestLoadConfigNamesFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "im.yaml")
	if err := os.WriteFile(p, []byte("nope: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := LoadConfig(p)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), `unknown key "nope"`) {
		t.Errorf("LoadConfig error = %v, want the path and the key", err)
	}
	if _, err := LoadConfig(p + ".missing"); err == nil {
		t.Error("missing file loaded")
	}
}

func TestExampleConfigsParse(t *testing.T) {
	files, _ := filepath.Glob("../configs/*.yaml")
	if len(files) == 0 {
		t.Fatal("no example configs found in configs/")
	}
	for _, f := range files {
		if _, err := LoadConfig(f); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

// TestReferenceConfigStarts: configs/infermesh.yaml runs as shipped. Only
// what cannot be shared on a test machine changes: the state, cache and
// socket paths and the ports. Everything else (admin.group included) is the
// file's.
func TestReferenceConfigStarts(t *testing.T) {
	cfg, err := LoadConfig("../configs/infermesh.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cfg.Node.StateDir = filepath.Join(dir, "state")
	cfg.Node.CacheDir = filepath.Join(dir, "cache")
	cfg.Admin.Socket = filepath.Join(dir, "admin.sock")
	if cfg.Mesh.Enabled() {
		t.Fatal("the reference config enables the mesh: it cannot start without a keyring file")
	}
	for name, r := range cfg.Roles {
		r.Port = testnet.TCPPort(t, "127.0.0.1")
		cfg.Roles[name] = r
	}
	a := runAgent(t, cfg, Options{})
	waitFor(t, "the admin socket", func() bool { _, ok := a.AdminSocket(); return ok })
}

func TestMetricsOffLoopbackWhenAllowed(t *testing.T) {
	cfg, err := ParseConfig([]byte("node: {name: a}\nadmin: {metrics: '0.0.0.0:9090', metrics_allow_remote: true}\n"))
	if err != nil || cfg.Admin.Metrics != "0.0.0.0:9090" {
		t.Errorf("metrics off loopback with metrics_allow_remote = %v", err)
	}
}

func TestInstanceResourcesAndStartup(t *testing.T) {
	cfg, err := ParseConfig([]byte(`
node: {name: a}
roles:
  big: {port: 1, instance: {image: vllm:local, port: 8000, gpus: all, shm_size: 8g, memory: 32g, cpus: 4.5, startup_timeout: 15m}}
  ids: {port: 2, instance: {image: x, port: 8000, gpus: [0, GPU-3a1b]}}
  two: {port: 3, instance: {image: x, port: 8000, gpus: 2}}
  none: {port: 4, instance: {image: x, port: 8000}}
`))
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.desiredInstances()
	want := map[string]*provision.Resources{
		"big":  {GPUs: "all", ShmSize: 8 << 30, Memory: 32 << 30, NanoCPUs: 4_500_000_000},
		"ids":  {GPUs: "0,GPU-3a1b"},
		"two":  {GPUs: "2"},
		"none": nil,
	}
	for role, w := range want {
		if got := d[role].Resources; !reflect.DeepEqual(got, w) {
			t.Errorf("%s: resources = %+v, want %+v", role, got, w)
		}
	}
	if got := d["big"].StartTimeout; got != 15*time.Minute {
		t.Errorf("big: start timeout = %v, want 15m", got)
	}
	if got := d["none"].StartTimeout; got != 2*time.Minute {
		t.Errorf("none: start timeout = %v, want the 2m default", got)
	}
}
