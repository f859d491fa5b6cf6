package agent

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/store"
)

// certFixture is a node a's state dir with its node key, the authority
// that admits it, and another authority.
type certFixture struct {
	dir, state      string
	key             ed25519.PrivateKey
	auth, other     ed25519.PrivateKey
	authPub, keyPub string
}

func newCertFixture(t *testing.T) *certFixture {
	t.Helper()
	f := &certFixture{dir: t.TempDir()}
	f.state = filepath.Join(f.dir, "state")
	if err := os.MkdirAll(f.state, 0o700); err != nil {
		t.Fatal(err)
	}
	var err error
	if f.key, err = identity.WriteNewKey(filepath.Join(f.state, identity.NodeKeyFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := identity.WriteNewKeyring(filepath.Join(f.state, "keyring.json")); err != nil {
		t.Fatal(err)
	}
	_, f.auth, _ = ed25519.GenerateKey(rand.Reader)
	_, f.other, _ = ed25519.GenerateKey(rand.Reader)
	f.authPub = identity.EncodeAuthorityKey(f.auth.Public().(ed25519.PublicKey))
	f.keyPub = identity.EncodeNodeKey(f.key.Public().(ed25519.PublicKey))
	return f
}

// cert issues a certificate for name and pub by authority, valid for ttl.
func (f *certFixture) cert(t *testing.T, authority ed25519.PrivateKey, name string, pub ed25519.PublicKey, ttl time.Duration) string {
	t.Helper()
	c, err := identity.IssueCertificate(authority, name, pub, identity.ScopeFull, ttl, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return c.String()
}

// config is node a's config: state in the fixture, a mesh when mesh, the
// trust section given, and a role a static upstream serves.
func (f *certFixture) config(t *testing.T, mesh bool, trust string) *Config {
	t.Helper()
	m := ""
	if mesh {
		m = fmt.Sprintf("mesh: {bind: '127.0.0.1:%d', quic: '127.0.0.1:%d'}\n", testnet.TCPUDPPort(t, "127.0.0.1"), testnet.UDPPort(t, "127.0.0.1"))
	}
	cfg, err := ParseConfig([]byte(fmt.Sprintf("node: {name: a, state_dir: %s}\n%strust: %s\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:9'}\n",
		f.state, m, trust)))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestPreflightCertificate: this node's admission certificate is checked
// against trust.authority, node.name and the node key in the state dir;
// what the agent could not start with (or would start with unadmitted) is
// an error naming the field and the cause, and an expiry is a warning (the
// agent starts and serves its local roles).
func TestPreflightCertificate(t *testing.T) {
	f := newCertFixture(t)
	pub := f.key.Public().(ed25519.PublicKey)
	_, stranger, _ := ed25519.GenerateKey(rand.Reader)
	strangerPub := stranger.Public().(ed25519.PublicKey)
	day := 24 * time.Hour
	trust := func(cert string) string { return fmt.Sprintf("{authority: %q, certificate: %q}", f.authPub, cert) }
	good := f.cert(t, f.auth, "a", pub, 30*day)
	if err := os.WriteFile(filepath.Join(f.state, "node.cert"), []byte(good+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.state, "junk.cert"), []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name      string
		mesh      bool
		trust     string
		wantErr   string   // the exact error; "" for none
		wantWarns []string // the exact warnings
	}{
		{name: "good", mesh: true, trust: trust(good)},
		{name: "good, from a file in the state dir", mesh: true, trust: trust("node.cert")},
		{name: "another authority", mesh: true, trust: trust(f.cert(t, f.other, "a", pub, 30*day)),
			wantErr: "trust.certificate: not signed by trust.authority (" + f.authPub + "): it was issued by another authority, or altered, and no node that trusts this authority would admit this node; issue one with the authority key of trust.authority"},
		{name: "another authority, without a mesh", trust: trust(f.cert(t, f.other, "a", pub, 30*day)),
			wantErr: "trust.certificate: not signed by trust.authority (" + f.authPub + "): it was issued by another authority, or altered, and no node that trusts this authority would admit this node; issue one with the authority key of trust.authority"},
		{name: "another name", mesh: true, trust: trust(f.cert(t, f.auth, "b", pub, 30*day)),
			wantErr: `trust.certificate: issued to node "b", but node.name is "a": issue one for "a" (infermesh authority issue --name a)`},
		{name: "another key", mesh: true, trust: trust(f.cert(t, f.auth, "a", strangerPub, 30*day)),
			wantErr: "trust.certificate: issued for the public key " + identity.EncodeNodeKey(strangerPub) + ", but this node's key (" + filepath.Join(f.state, "node.key") + ") is " + f.keyPub + ": peers would refuse it; issue one for " + f.keyPub},
		{name: "not a certificate nor a file", mesh: true, trust: trust("nope.cert"),
			wantErr: "trust.certificate: neither an admission certificate (bad admission certificate: illegal base64 data at input byte 4) nor a readable file (open " + filepath.Join(f.state, "nope.cert") + ": no such file or directory)"},
		{name: "a file without a certificate", mesh: true, trust: trust("junk.cert"),
			wantErr: "trust.certificate: the file " + filepath.Join(f.state, "junk.cert") + " does not hold an admission certificate: bad admission certificate: illegal base64 data at input byte 3"},
		{name: "expired", mesh: true, trust: trust(f.cert(t, f.auth, "a", pub, time.Second)),
			wantWarns: []string{"trust.certificate: expired at "}},
		{name: "expires soon", mesh: true, trust: trust(f.cert(t, f.auth, "a", pub, 2*day)),
			wantWarns: []string{"trust.certificate: expires at "}},
		{name: "no authority to check it by", mesh: true, trust: fmt.Sprintf("{certificate: %q}", good),
			wantWarns: []string{"trust.certificate: not checked against an authority: trust.authority is not set, so only peers whose authority signed it admit this node"}},
		{name: "none", mesh: true, trust: "{}"},
	}
	now := time.Now().Add(2 * time.Second) // the one-second certificate has expired
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := f.config(t, tt.mesh, tt.trust)
			warns, err := cfg.Preflight(now)
			var fe *FieldError
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Preflight: %v, want no error", err)
			case tt.wantErr != "" && (err == nil || err.Error() != tt.wantErr || !errors.As(err, &fe)):
				t.Fatalf("Preflight error =\n  %v\nwant the *FieldError\n  %s", err, tt.wantErr)
			}
			if len(warns) != len(tt.wantWarns) {
				t.Fatalf("warnings = %q, want %d: %q", warns, len(tt.wantWarns), tt.wantWarns)
			}
			for i, w := range tt.wantWarns {
				if !strings.HasPrefix(warns[i], w) {
					t.Errorf("warning %d = %q, want it to start %q", i, warns[i], w)
				}
			}
		})
	}
}

// TestPreflightNodeKey: where the certificate cannot be compared with the
// node key because there is none yet, a node with a mesh is refused (the
// key its start would make cannot match); without a mesh no key is made
// and nothing is compared. A node key the mesh would refuse is refused.
func TestPreflightNodeKey(t *testing.T) {
	f := newCertFixture(t)
	keyPath := filepath.Join(f.state, identity.NodeKeyFile)
	trust := fmt.Sprintf("{authority: %q, certificate: %q}", f.authPub, f.cert(t, f.auth, "a", f.key.Public().(ed25519.PublicKey), time.Hour*24*30))
	if err := os.Chmod(keyPath, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := f.config(t, true, trust).Preflight(time.Now())
	if want := "node.state_dir: bad key file " + keyPath + ": mode 0644, want 0600 (no group or other access)"; err == nil || err.Error() != want {
		t.Errorf("a node key open to others: %v, want %s", err, want)
	}
	if err := os.Remove(keyPath); err != nil {
		t.Fatal(err)
	}
	_, err = f.config(t, true, trust).Preflight(time.Now())
	want := "trust.certificate: issued for the public key " + f.keyPub + ", but this node has no key yet (" + keyPath + "): the one the agent would make at its start cannot match; make it first (infermeshd --keygen) and issue the certificate for the public key that prints"
	if err == nil || err.Error() != want {
		t.Errorf("no node key, with a mesh: %v\nwant %s", err, want)
	}
	if _, err := f.config(t, false, trust).Preflight(time.Now()); err != nil {
		t.Errorf("no node key, without a mesh: %v, want no error", err)
	}
}

// TestPreflightKeyring: with a mesh, a gossip keyring the mesh would
// refuse to start with is refused, naming the field and what to do.
func TestPreflightKeyring(t *testing.T) {
	f := newCertFixture(t)
	path := filepath.Join(f.state, "keyring.json")
	if _, err := f.config(t, true, "{}").Preflight(time.Now()); err != nil {
		t.Fatalf("a good keyring: %v", err)
	}
	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	_, err := f.config(t, true, "{}").Preflight(time.Now())
	if want := "mesh.gossip_keyring: gossip keyring " + path + ": mode 0640, want 0600 (no group or other access)"; err == nil || err.Error() != want {
		t.Errorf("a keyring open to the group: %v, want %s", err, want)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	_, err = f.config(t, true, "{}").Preflight(time.Now())
	if want := "mesh.gossip_keyring: " + path + " does not exist: every node of a mesh needs the cluster's gossip keyring; copy it from a member (0600), or make the first node's with infermesh keygen --gossip --keyring " + path; err == nil || err.Error() != want {
		t.Errorf("no keyring: %v\nwant %s", err, want)
	}
	if _, err := f.config(t, false, "{}").Preflight(time.Now()); err != nil {
		t.Errorf("no keyring, without a mesh: %v, want no error", err)
	}
}

// TestRunRefusesACertificateOfAnotherAuthority: Run refuses what Preflight
// refuses, before it binds anything: the agent would otherwise start, and
// no peer would ever admit it.
func TestRunRefusesACertificateOfAnotherAuthority(t *testing.T) {
	f := newCertFixture(t)
	cfg := f.config(t, true, fmt.Sprintf("{authority: %q, certificate: %q}", f.authPub, f.cert(t, f.other, "a", f.key.Public().(ed25519.PublicKey), time.Hour)))
	cfg.Admin.Socket = filepath.Join(f.dir, "admin.sock")
	a, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	// An agent that starts runs until the context ends: the bound only
	// stops it, it is no measure.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	err = a.Run(ctx)
	if ctx.Err() != nil {
		t.Fatalf("Run started the agent (and returned %v when stopped); want it refused", err)
	}
	if fe := (*FieldError)(nil); !errors.As(err, &fe) || fe.Field != "trust.certificate" {
		t.Fatalf("Run = %v, want a *FieldError for trust.certificate", err)
	}
	if _, err := os.Stat(cfg.Admin.Socket); err == nil {
		t.Error("the refused start opened its admin socket")
	}
}

// TestUnservableRoles: a role without upstream or instance that no peer
// may serve (or with no mesh to reach one) is reported, with the reason
// and what to add; one a peer may serve is not.
func TestUnservableRoles(t *testing.T) {
	const mesh = "mesh: {bind: '127.0.0.1:7946', quic: '127.0.0.1:7947'}\ntrust: {nodes: [{name: b, public_key: c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8=}]}\n"
	tests := []struct {
		name, yaml string
		want       []string
	}{
		{"no mesh", "roles:\n  chat: {port: 1}\n", []string{
			"roles.chat: nothing can serve it: it has no upstream and no instance, and no mesh is configured (mesh.bind), so no peer can; add roles.chat.upstream (http://127.0.0.1:<port> of a running server) or roles.chat.instance"}},
		{"no mesh, peers named", "roles:\n  chat: {port: 1, accept_from: [b]}\n", []string{
			"roles.chat: nothing can serve it: it has no upstream and no instance, and its accept_from names peers, but no mesh is configured (mesh.bind) to reach them; add roles.chat.upstream (http://127.0.0.1:<port> of a running server) or roles.chat.instance, or configure the mesh"}},
		{"a mesh, no peer allowed", mesh + "roles:\n  chat: {port: 1}\n", []string{
			"roles.chat: nothing can serve it: it has no upstream and no instance, and its accept_from names no peer (run-time overrides aside: infermesh policy lists them); add roles.chat.upstream (http://127.0.0.1:<port> of a running server) or roles.chat.instance, or name the peers that may serve it in roles.chat.accept_from (or at run time: infermesh allow chat NODE)"}},
		{"a mesh, a peer allowed", mesh + "roles:\n  chat: {port: 1, accept_from: [b]}\n", nil},
		{"an upstream", "roles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:9'}\n", nil},
		{"an instance", "roles:\n  chat: {port: 1, instance: {runtime: simulated}}\n", nil},
		{"two roles", "roles:\n  b: {port: 2}\n  a: {port: 1, upstream: 'http://127.0.0.1:9'}\n  c: {port: 3}\n", []string{
			"roles.b: nothing can serve it: it has no upstream and no instance, and no mesh is configured (mesh.bind), so no peer can; add roles.b.upstream (http://127.0.0.1:<port> of a running server) or roles.b.instance",
			"roles.c: nothing can serve it: it has no upstream and no instance, and no mesh is configured (mesh.bind), so no peer can; add roles.c.upstream (http://127.0.0.1:<port> of a running server) or roles.c.instance"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			if _, err := identity.WriteNewKeyring(filepath.Join(dir, "keyring.json")); err != nil {
				t.Fatal(err)
			}
			cfg, err := ParseConfig([]byte(fmt.Sprintf("node: {name: a, state_dir: %q}\n", dir) + tt.yaml))
			if err != nil {
				t.Fatal(err)
			}
			got, err := cfg.Preflight(time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("warnings =\n  %q\nwant\n  %q", got, tt.want)
			}
		})
	}
}

// TestRunWarnsOfUnservableRoles: the agent logs a role nothing can serve
// when it starts, counting the run-time overrides of its state store: a
// role an `infermesh allow` lets a peer serve is not reported.
func TestRunWarnsOfUnservableRoles(t *testing.T) {
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, store.FileName), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Put(store.Override{Kind: store.KindAcceptFrom, Role: "allowed", Node: "b", On: true}); err != nil {
		t.Fatal(err)
	}
	st.Close()
	if _, err := identity.WriteNewKeyring(filepath.Join(dir, "keyring.json")); err != nil {
		t.Fatal(err)
	}
	if _, err := identity.WriteNewKey(filepath.Join(dir, identity.NodeKeyFile)); err != nil {
		t.Fatal(err)
	}
	ip := fmt.Sprintf("127.0.1.%d", 10+nextMeshIP.Add(1)%240)
	cfg, err := ParseConfig([]byte(fmt.Sprintf(`node: {name: a, state_dir: %s}
admin: {socket: %s/admin.sock}
mesh: {bind: "%s:%d", quic: "%s:%d"}
trust: {nodes: [{name: b, public_key: c2gizNIRmOKSn6exQlbMyiu0FdmLWInlPtFNdMJFdi8=}]}
roles:
  allowed: {port: 1}
  alone: {port: 2}
`, dir, dir, ip, testnet.TCPUDPPort(t, ip), ip, testnet.TCPUDPPort(t, ip))))
	if err != nil {
		t.Fatal(err)
	}
	for name, r := range cfg.Roles {
		r.Port = 0
		cfg.Roles[name] = r
	}
	core, logs := observer.New(zapcore.WarnLevel)
	a := runAgent(t, cfg, Options{Logger: zap.New(core)})
	waitFor(t, "the admin socket", func() bool { _, ok := a.AdminSocket(); return ok })
	var got []string
	for _, e := range logs.FilterMessageSnippet("nothing can serve it").All() {
		got = append(got, e.Message)
	}
	want := []string{"roles.alone: nothing can serve it: it has no upstream and no instance, and no peer may serve it to this node (accept_from names none, and no run-time override allows one); add roles.alone.upstream (http://127.0.0.1:<port> of a running server) or roles.alone.instance, or name the peers that may serve it in roles.alone.accept_from (or at run time: infermesh allow alone NODE)"}
	if !slices.Equal(got, want) {
		t.Errorf("start-up warnings =\n  %q\nwant\n  %q", got, want)
	}
}
