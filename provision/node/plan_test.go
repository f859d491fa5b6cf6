package node

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/internal/testing/testbin"
)

func TestNewPlan(t *testing.T) {
	bins, err := testbin.Build(t.TempDir(), "./provision/internal/testbin/rowrite")
	if err != nil {
		t.Fatal(err)
	}
	static := bins["rowrite"]
	spec := testSpec(KindSSH)
	spec.SSH.Host = "gpu-7.lab"
	pc := PlanConfig{
		Spec: spec, Site: "lab", Cluster: "infermesh", Bootstrapper: Agent{Name: "hub", PublicKey: fakeNodeKey},
		Authority: fakeNodeKey, Keyring: []string{"k1", "k2"}, AgentBinary: static, CLIBinary: static, DemoBinary: static, DemoModel: "demo",
		Unit: []byte("[Unit]\n"), Sysusers: []byte("u infermesh -\n"), User: "infermesh", AdminGroup: "infermesh-admin",
		Issue: func(_ context.Context, name, pub string) (string, error) {
			return "cert(" + name + "," + pub + ")", nil
		},
		Resolve: func(_ context.Context, host string) ([]net.IP, error) {
			if host != "gpu-7.lab" {
				return nil, errors.New("no such host")
			}
			return []net.IP{net.ParseIP("fd00::7"), net.ParseIP("10.0.0.7")}, nil
		},
	}

	t.Run("refuses a dynamically linked agent", func(t *testing.T) {
		dyn := pc
		dyn.AgentBinary = "/bin/ls"
		if _, _, err := NewPlan(dyn); err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
			t.Errorf("NewPlan(/bin/ls) = %v, want a dynamic-linking refusal", err)
		}
	})

	boot, plan, err := NewPlan(pc)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range boot.Verify {
		names = append(names, c.Name)
	}
	got := strings.Join(names, ", ")
	for _, want := range []string{"systemd", "architecture", "tools", "absent /var/lib/infermesh", "absent /etc/infermesh",
		"absent /usr/local/bin/infermeshd", "absent /usr/local/bin/infermesh,", "absent /usr/local/bin/infermesh-demo", "absent /etc/systemd/system/infermeshd.service",
		"absent /etc/systemd/system/infermesh-demo.service", "absent " + SysusersFile, "systemd, architecture"} {
		if !strings.Contains(got, want) {
			t.Errorf("checks %s lack %s", got, want)
		}
	}
	if strings.Contains(got, "absent /etc/infermesh/infermesh.yaml") || strings.Contains(got, "absent "+KeyringFile) {
		t.Errorf("checks %s test paths inside directories the install creates", got)
	}

	in, err := plan(context.Background(), Endpoint{Host: "gpu-7.lab", Port: 22, User: "root"})
	if err != nil {
		t.Fatal(err)
	}
	if in.Files[0].Path != ConfigFile || !strings.Contains(string(in.Files[0].Data), "advertise: 10.0.0.7:7946") {
		t.Errorf("config = %s\n%s, want the node's resolved IPv4 advertised", in.Files[0].Path, in.Files[0].Data)
	}
	if a := in.Account; a == nil || a.User != "infermesh" || a.Sysusers.Path != SysusersFile || string(a.Sysusers.Data) != "u infermesh -\n" || !slices.Equal(a.JoinIfPresent, []string{"docker"}) {
		t.Errorf("account = %+v, want user infermesh from %s, joining docker where it exists", a, SysusersFile)
	}
	if in.Files[0].Group != "infermesh" || in.Files[0].Mode != 0o640 {
		t.Errorf("config file %04o group %q, want 0640 readable by group infermesh", in.Files[0].Mode, in.Files[0].Group)
	}
	if in.Units[0] != DemoUnit || in.Units[1] != AgentUnit || len(in.Uploads) != 3 || in.Uploads[0].SHA256 == "" {
		t.Errorf("install = %+v, want the demo unit first and the three uploads with digests", in)
	}
	// The operator's CLI beside the agent, as the agent is installed; it
	// reaches the node's agent on its default socket, which the admin
	// group may use.
	if u := in.Uploads[1]; u.Path != BinDir+"/infermesh" || u.Mode != 0o755 || u.SHA256 != in.Uploads[0].SHA256 {
		t.Errorf("CLI upload = %+v, want %s/infermesh 0755 with its digest", u, BinDir)
	}
	for _, want := range []string{"socket: /run/infermesh/admin.sock", "group: infermesh-admin"} {
		if !strings.Contains(string(in.Files[0].Data), want) {
			t.Errorf("config lacks %q:\n%s", want, in.Files[0].Data)
		}
	}
	noCLI := pc
	noCLI.CLIBinary = ""
	if _, _, err := NewPlan(noCLI); err == nil || !strings.Contains(err.Error(), "CLIBinary") {
		t.Errorf("NewPlan without the CLI = %v, want a refusal", err)
	}
	for _, f := range in.Files {
		if f.Path == KeyringFile && (f.Mode != 0o600 || string(f.Data) != "[\"k1\",\"k2\"]\n") {
			t.Errorf("keyring file %o %q, want 0600 with both keys", f.Mode, f.Data)
		}
	}
	cert, err := in.Issue(context.Background(), "PUB")
	if err != nil || cert.Path != CertFile || string(cert.Data) != "cert(gpu-7,PUB)\n" || cert.Mode != 0o600 {
		t.Errorf("certificate file = %+v, %v", cert, err)
	}
	if _, err := plan(context.Background(), Endpoint{Host: "nowhere.lab"}); err == nil || !strings.Contains(err.Error(), "--advertise") {
		t.Errorf("plan for an unresolvable host = %v, want a hint at --advertise", err)
	}
}
