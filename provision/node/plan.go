package node

import (
	"github.com/infermesh/infermesh/config"

	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Where a bootstrap puts things on a node.
const (
	BinDir       = "/usr/local/bin"
	ConfigDir    = config.DefaultDir
	StateDir     = config.DefaultStateDir
	CacheDir     = config.DefaultCacheDir // the unit's CacheDirectory: native instances' caches
	UnitDir      = "/etc/systemd/system"
	SysusersFile = "/etc/sysusers.d/infermesh.conf"
	AgentUnit    = "infermeshd.service"
	DemoUnit     = "infermesh-demo.service"
	ConfigFile   = config.DefaultFile
	CertFile     = StateDir + "/node.cert"
	KeyringFile  = StateDir + "/keyring.json"
	// MeshPort and QUICPort are the node's gossip and QUIC ports.
	MeshPort = 7946
	QUICPort = 7947
	// DemoListen is where the demo model serves on the node.
	DemoListen = "127.0.0.1:18180"
	// AdminSocket is the node agent's admin socket: the infermesh CLI's
	// default, so that infermesh status on the node needs no flag.
	AdminSocket = config.DefaultAdminSocket
)

// JoinCredentialRef is where a node keeps its join credential.
const JoinCredentialRef = "file:" + CertFile

// Plan renders what a session installs once the node's SSH endpoint is
// known (its address goes into the node's mesh config).
type Plan func(ctx context.Context, ep Endpoint) (Install, error)

// Agent names a node by name and public key (base64).
type Agent struct {
	Name      string
	PublicKey string
}

// PlanConfig is what a plan needs from the bootstrapping agent.
type PlanConfig struct {
	Spec Spec
	// Site and Cluster the node joins.
	Site, Cluster string
	// Bootstrapper is this agent: the node trusts it statically (its
	// certificate, if it has one, would do too; the static entry pins its
	// key whatever it presents).
	Bootstrapper Agent
	// Authority is the public key (base64) that signs admission
	// certificates; Issue signs the node's.
	Authority string
	Issue     func(ctx context.Context, name, publicKey string) (certificate string, err error)
	// Keyring is the gossip keyring (base64 keys, primary first). It is a
	// secret: it lives in the plan only, never in the stored spec.
	Keyring []string
	// AgentBinary is the static infermeshd uploaded to the node.
	AgentBinary string
	// CLIBinary is the static infermesh CLI uploaded beside it, so that
	// an operator on the node can run infermesh status there.
	CLIBinary string
	// DemoBinary, when set, is the demo model, installed as DemoUnit and
	// serving on DemoListen as DemoModel.
	DemoBinary, DemoModel string
	// Unit is the infermeshd systemd unit (configs/infermeshd.service).
	Unit []byte
	// Sysusers (configs/infermesh.sysusers) declares User, the user the
	// unit runs as: the install creates it first, adds it to the docker
	// group where the host has one, and gives the config file its group.
	// Both empty: the unit runs as root.
	Sysusers []byte
	User     string
	// AdminGroup is the node's admin.group (Sysusers declares it, with
	// User in it): its members may use the node's admin socket. Empty:
	// only root.
	AdminGroup string
	// Resolve looks a host name up (ssh hosts given by name); nil:
	// net.DefaultResolver.
	Resolve func(ctx context.Context, host string) ([]net.IP, error)
}

// binary is a checked local executable.
type binary struct {
	path, sha256, arch string
}

// checkBinary refuses what cannot run on a bare host: anything but a
// statically linked ELF executable. It returns the sha256 and the
// architecture (as uname -m prints it).
func checkBinary(p string) (binary, error) {
	f, err := elf.Open(p)
	if err != nil {
		return binary{}, fmt.Errorf("%s: %w", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return binary{}, fmt.Errorf("%s is dynamically linked; build it with CGO_ENABLED=0 (make build)", p)
		}
	}
	arch := map[elf.Machine]string{elf.EM_X86_64: "x86_64", elf.EM_AARCH64: "aarch64"}[f.Machine]
	if arch == "" {
		return binary{}, fmt.Errorf("%s: unsupported architecture %v", p, f.Machine)
	}
	r, err := os.Open(p)
	if err != nil {
		return binary{}, err
	}
	defer r.Close()
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		return binary{}, fmt.Errorf("%s: %w", p, err)
	}
	return binary{path: p, sha256: hex.EncodeToString(h.Sum(nil)), arch: arch}, nil
}

// DefaultBoot is what every session reads and checks before installing:
// the boot log (the kernel, the boot state once systemd finished booting,
// failed units as warnings) and the host fitness checks.
func DefaultBoot(arch string) BootSpec {
	return BootSpec{
		StdoutSources: []string{"uname -srm", "systemctl is-system-running --wait || true"},
		StderrSources: []string{"systemctl --failed --plain --no-legend --no-pager || true"},
		Verify: []Check{
			{Name: "systemd", Command: "test -d /run/systemd/system",
				Hint: "the host does not run systemd (no /run/systemd/system): infermeshd is installed as a systemd unit"},
			{Name: "architecture", Command: "test \"$(uname -m)\" = " + arch,
				Hint: "the agent binary is built for " + arch},
			{Name: "tools", Command: "command -v sha256sum && command -v install && command -v journalctl && command -v systemd-sysusers && command -v usermod",
				Hint: "sha256sum, install, journalctl, systemd-sysusers and usermod are needed"},
		},
	}
}

// NewPlan checks the binaries and returns the boot checks (the default
// ones, one per path the install creates that must not exist yet, then
// the spec's own) and the plan.
func NewPlan(pc PlanConfig) (BootSpec, Plan, error) {
	if pc.Issue == nil || pc.AgentBinary == "" || pc.CLIBinary == "" || len(pc.Keyring) == 0 || len(pc.Unit) == 0 {
		return BootSpec{}, nil, errors.New("plan: Issue, AgentBinary, CLIBinary, Keyring and Unit are required")
	}
	if pc.AdminGroup != "" && pc.User == "" {
		return BootSpec{}, nil, errors.New("plan: AdminGroup needs the User (in it) and the Sysusers that declares it")
	}
	if (len(pc.Sysusers) == 0) != (pc.User == "") {
		return BootSpec{}, nil, errors.New("plan: Sysusers and User go together")
	}
	agent, err := checkBinary(pc.AgentBinary)
	if err != nil {
		return BootSpec{}, nil, fmt.Errorf("agent binary: %w", err)
	}
	cli, err := checkBinary(pc.CLIBinary)
	if err != nil {
		return BootSpec{}, nil, fmt.Errorf("infermesh CLI binary: %w", err)
	}
	if cli.arch != agent.arch {
		return BootSpec{}, nil, fmt.Errorf("infermesh CLI binary is %s, the agent %s", cli.arch, agent.arch)
	}
	var demo binary
	if pc.DemoBinary != "" {
		if demo, err = checkBinary(pc.DemoBinary); err != nil {
			return BootSpec{}, nil, fmt.Errorf("demo binary: %w", err)
		}
		if demo.arch != agent.arch {
			return BootSpec{}, nil, fmt.Errorf("demo binary is %s, the agent %s", demo.arch, agent.arch)
		}
	}
	keyring, err := json.Marshal(pc.Keyring)
	if err != nil {
		return BootSpec{}, nil, err
	}
	static := Install{
		Dirs:       []Dir{{Path: StateDir, Mode: 0o700}, {Path: CacheDir, Mode: 0o700}, {Path: ConfigDir, Mode: 0o755}},
		StagingDir: StateDir,
		Uploads: []Upload{
			{Path: BinDir + "/infermeshd", Mode: 0o755, Local: agent.path, SHA256: agent.sha256},
			// The operator's tool on the node: its default socket is the
			// node agent's (admin.socket below).
			{Path: BinDir + "/infermesh", Mode: 0o755, Local: cli.path, SHA256: cli.sha256},
		},
		Files: []File{
			{Path: KeyringFile, Mode: 0o600, Data: append(keyring, '\n')},
			{Path: UnitDir + "/" + AgentUnit, Mode: 0o644, Data: pc.Unit},
		},
		Keygen: BinDir + "/infermeshd -config " + ConfigFile + " -keygen",
		Units:  []string{AgentUnit},
	}
	if pc.User != "" {
		// The docker group, where there is one, gives the agent the
		// Docker socket for managed containers.
		static.Account = &Account{Sysusers: File{Path: SysusersFile, Mode: 0o644, Data: pc.Sysusers}, User: pc.User, JoinIfPresent: []string{"docker"}}
	}
	if pc.DemoBinary != "" {
		static.Uploads = append(static.Uploads, Upload{Path: BinDir + "/infermesh-demo", Mode: 0o755, Local: demo.path, SHA256: demo.sha256})
		static.Files = append(static.Files, File{Path: UnitDir + "/" + DemoUnit, Mode: 0o644, Data: []byte(demoUnit(pc.DemoModel))})
		static.Units = []string{DemoUnit, AgentUnit}
	}
	// The config file's path joins the others for the absence checks.
	probe := static
	probe.Files = append(probe.Files, File{Path: ConfigFile})
	boot := DefaultBoot(agent.arch)
	boot.Verify = append(boot.Verify, probe.FreshChecks()...)
	boot.Verify = append(boot.Verify, pc.Spec.Boot.Verify...)
	boot.StdoutSources = append(boot.StdoutSources, pc.Spec.Boot.StdoutSources...)
	boot.StderrSources = append(boot.StderrSources, pc.Spec.Boot.StderrSources...)

	plan := func(ctx context.Context, ep Endpoint) (Install, error) {
		adv, err := advertiseIP(ctx, pc, ep)
		if err != nil {
			return Install{}, err
		}
		cfg, err := nodeConfigYAML(pc, adv)
		if err != nil {
			return Install{}, err
		}
		in := static
		// Root's, readable by the agent's group; the state directory is
		// the agent's: systemd hands it (and the key, keyring and
		// certificate written into it here as root) to User at the
		// first start (StateDirectory=).
		in.Files = append([]File{{Path: ConfigFile, Mode: 0o640, Data: cfg, Group: pc.User}}, static.Files...)
		name := pc.Spec.Name
		in.Issue = func(ctx context.Context, pub string) (File, error) {
			cert, err := pc.Issue(ctx, name, pub)
			if err != nil {
				return File{}, err
			}
			return File{Path: CertFile, Mode: 0o600, Data: []byte(cert + "\n")}, nil
		}
		return in, nil
	}
	return boot, plan, nil
}

// advertiseIP is the node's mesh address: the spec's, or the endpoint's
// host (looked up when it is a name).
func advertiseIP(ctx context.Context, pc PlanConfig, ep Endpoint) (string, error) {
	host := ep.Host
	if pc.Spec.SSH != nil && pc.Spec.SSH.Advertise != "" {
		host = pc.Spec.SSH.Advertise
	}
	if ip := net.ParseIP(host); ip != nil {
		return ip.String(), nil
	}
	resolve := pc.Resolve
	if resolve == nil {
		resolve = func(ctx context.Context, h string) ([]net.IP, error) {
			return net.DefaultResolver.LookupIP(ctx, "ip", h)
		}
	}
	ips, err := resolve(ctx, host)
	if err != nil || len(ips) == 0 {
		return "", fmt.Errorf("the node's mesh address: %s does not resolve (%v); give it with --advertise", host, err)
	}
	for _, ip := range ips {
		if ip.To4() != nil {
			return ip.String(), nil
		}
	}
	return ips[0].String(), nil
}

// nodeConfig is the subset of the agent's config file a node gets (the
// agent package owns the schema; its tests parse what this writes).
type nodeConfig struct {
	Node  nodeSection           `yaml:"node"`
	Site  string                `yaml:"site"`
	Mesh  meshSection           `yaml:"mesh"`
	Trust trustSection          `yaml:"trust"`
	Admin adminSection          `yaml:"admin"`
	Roles map[string]roleConfig `yaml:"roles"`
}

type nodeSection struct {
	Name     string `yaml:"name"`
	StateDir string `yaml:"state_dir"`
}

type meshSection struct {
	Cluster       string   `yaml:"cluster"`
	Bind          string   `yaml:"bind"`
	Advertise     string   `yaml:"advertise"`
	QUIC          string   `yaml:"quic"`
	QUICAdvertise string   `yaml:"quic_advertise"`
	Join          []string `yaml:"join"`
	GossipKeyring string   `yaml:"gossip_keyring"`
}

type trustSection struct {
	Authority   string        `yaml:"authority"`
	Certificate string        `yaml:"certificate"`
	Nodes       []trustedNode `yaml:"nodes,omitempty"`
}

type trustedNode struct {
	Name      string `yaml:"name"`
	PublicKey string `yaml:"public_key"`
}

type adminSection struct {
	Socket string `yaml:"socket"`
	Group  string `yaml:"group,omitempty"`
}

type roleConfig struct {
	Port     int      `yaml:"port"`
	Upstream string   `yaml:"upstream"`
	Model    string   `yaml:"model,omitempty"`
	Expose   bool     `yaml:"expose"`
	ServeTo  []string `yaml:"serve_to"`
}

// NodeConfig renders the node's config file with adv as its mesh address.
// Exported for the agent's tests, which parse it with the real loader.
func NodeConfig(pc PlanConfig, adv string) ([]byte, error) { return nodeConfigYAML(pc, adv) }

func nodeConfigYAML(pc PlanConfig, adv string) ([]byte, error) {
	s := pc.Spec
	c := nodeConfig{
		Node: nodeSection{Name: s.Name, StateDir: StateDir},
		Site: pc.Site,
		Mesh: meshSection{
			Cluster:       pc.Cluster,
			Bind:          net.JoinHostPort("0.0.0.0", strconv.Itoa(MeshPort)),
			Advertise:     net.JoinHostPort(adv, strconv.Itoa(MeshPort)),
			QUIC:          net.JoinHostPort("0.0.0.0", strconv.Itoa(QUICPort)),
			QUICAdvertise: net.JoinHostPort(adv, strconv.Itoa(QUICPort)),
			Join:          s.Join,
			GossipKeyring: path.Base(KeyringFile),
		},
		Trust: trustSection{
			Authority:   pc.Authority,
			Certificate: path.Base(CertFile),
			Nodes:       []trustedNode{{Name: pc.Bootstrapper.Name, PublicKey: pc.Bootstrapper.PublicKey}},
		},
		// The CLI's default socket; operators in AdminGroup may use it.
		Admin: adminSection{Socket: AdminSocket, Group: pc.AdminGroup},
		Roles: map[string]roleConfig{},
	}
	for _, r := range s.Roles {
		c.Roles[r.Name] = roleConfig{Port: r.Port, Upstream: r.Upstream, Model: r.Model, Expose: true, ServeTo: []string{pc.Bootstrapper.Name}}
	}
	b, err := yaml.Marshal(c)
	if err != nil {
		return nil, err
	}
	head := "# Written by `infermesh node add " + s.Name + "` (run " + strconv.FormatUint(s.Run, 10) + ").\n" +
		"# The node serves its roles to " + pc.Bootstrapper.Name + "; extend serve_to to serve others.\n"
	return append([]byte(head), b...), nil
}

func demoUnit(model string) string {
	if model == "" {
		model = "demo"
	}
	return strings.Join([]string{
		"[Unit]",
		"Description=infermesh demo model (a deterministic test upstream)",
		"Before=" + AgentUnit,
		"",
		"[Service]",
		"ExecStart=" + BinDir + "/infermesh-demo -listen " + DemoListen + " -model " + model,
		"Restart=on-failure",
		"NoNewPrivileges=yes",
		"",
		"[Install]",
		"WantedBy=multi-user.target",
		"",
	}, "\n")
}
