package mesh

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/defaults"
	"github.com/infermesh/infermesh/placement"
)

// AdvertSink is where the mesh delivers verified adverts and where it reads
// this node's own; *placement.Table satisfies it.
//
// All methods must be safe for concurrent use and must not block: the mesh
// calls them from memberlist's receive paths, with its advert lock held so
// that the calls for one origin arrive in the order the mesh decided them.
// They must not call back into the Mesh except through placement.Admission.
type AdvertSink interface {
	// IngestAdvertisement hears an advert verified as coming from sender; a
	// refusal is returned as an error (a *placement.RefusedError gives the
	// reason).
	IngestAdvertisement(sender string, ad placement.Advert) error
	// Withdraw forgets node's advert of role.
	Withdraw(role, node string)
	// RemoveNode forgets everything node advertised.
	RemoveNode(node string)
	// Advertisements returns this node's own adverts (exposed local roles).
	Advertisements() []placement.Advert
}

var _ AdvertSink = (*placement.Table)(nil)

// Defaults.
const (
	DefaultCluster        = "infermesh"
	DefaultBindAddr       = "0.0.0.0:7946"
	DefaultKeyringFile    = "keyring.json"
	DefaultJoinBackoff    = time.Second
	DefaultJoinMaxBackoff = 30 * time.Second
)

// Config configures a Mesh. The zero value of a field means its default
// (see DefaultConfig); StateDir is required.
type Config struct {
	// NodeName is this node's name, also its memberlist name. Default: the
	// host name.
	NodeName string
	// StateDir holds the node key (identity.NodeKeyFile) and, by default, the gossip
	// keyring. Required.
	StateDir string
	// KeyFile overrides the node key path. Default: StateDir/node.key.
	KeyFile string
	// Cluster is the cluster name: the memberlist label, and bound into
	// node meta and every signed advert. Default DefaultCluster.
	Cluster string
	// BindAddr is the gossip bind address, host:port. Port 0 picks a free
	// port (see Mesh.GossipAddr). Default DefaultBindAddr.
	BindAddr string
	// AdvertiseAddr is the gossip address other nodes use, host:port.
	// Default: derived from BindAddr by memberlist.
	AdvertiseAddr string
	// QUICAddr is this node's QUIC endpoint, host:port, carried in node
	// meta for peers (PeerAddr). Default: none.
	QUICAddr string
	// Join lists gossip addresses of existing members (see Mesh.Join). An
	// empty list is a valid single-node mesh.
	Join []string
	// KeyringPath is the gossip keyring file; relative paths are inside
	// StateDir. It must exist (see identity.WriteNewKeyring). Default
	// StateDir/keyring.json.
	KeyringPath string
	// Certificate is this node's admission certificate (text form), if the
	// cluster admits it by certificate rather than by static trust.
	Certificate string
	// Trust says which other nodes are admitted. Changeable at run time with
	// Mesh.SetTrust, Revoke and Unrevoke.
	Trust TrustConfig

	// AdvertTTL is how long a received advert counts; origins re-advertise
	// every AdvertTTL/3. Use the same value as the placement table.
	// Default placement.DefaultAdvertTTL.
	AdvertTTL time.Duration
	// GossipInterval is memberlist's gossip interval, and how often this
	// node compares its local roles with what it advertised (so a role that
	// stops being served is withdrawn within one interval). Default 200ms.
	GossipInterval time.Duration
	// GossipNodes is how many random members each gossip round sends the
	// queued broadcasts to. Default 3.
	GossipNodes int
	// ProbeInterval and ProbeTimeout drive failure detection. Defaults 1s
	// and 500ms.
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	// PushPullInterval is the full state sync interval. Default 30s.
	PushPullInterval time.Duration
	// AntiEntropyInterval is how often this node sends a digest of the
	// members it sees to one random member, four times as often for ten
	// intervals after a membership change; a member whose view differs
	// push/pulls with it (see antientropy.go). The push/pulls a node starts
	// are spaced by at least that interval x ceil(N/100). Default 1s.
	AntiEntropyInterval time.Duration
	// SuspicionMult scales how long a suspected node has to refute before it
	// is declared dead. Default 4.
	SuspicionMult int
	// RetransmitMult scales how often a broadcast (alive messages and
	// adverts) is retransmitted. Default 4. memberlist's loopback profile
	// uses 2; measured here, broadcasts then die out before reaching every
	// node and convergence falls back to push/pull (tens of seconds).
	RetransmitMult int
	// AdvertLoadBudget bounds, in bytes per second, what this node's
	// adverts of a change of load alone (capacity, running, waiting) may
	// cost each node of the mesh: every node sends an advert about
	// RetransmitMult x ceil(log10(N+1)) times, so a load change is
	// advertised at most once per that many bytes over the budget (at
	// least a second apart, at most AdvertTTL/3). A consumer that talks to
	// a peer has fresher load from its answers' load reports; adverts are
	// for the others. Default 400 (at N=1000, about one load advert every
	// 12 s; at N=10, every 2.5 s).
	AdvertLoadBudget int
	// TCPTimeout bounds push/pull and join connections. Default 10s.
	TCPTimeout time.Duration
	// JoinBackoff and JoinMaxBackoff bound Join's retry delay (doubling).
	// Defaults DefaultJoinBackoff and DefaultJoinMaxBackoff.
	JoinBackoff    time.Duration
	JoinMaxBackoff time.Duration
	// RejoinInterval is how often Heal looks for configured and known
	// peers that are not live members, and the first backoff of each;
	// RejoinMaxBackoff caps the doubling. Defaults DefaultRejoinInterval
	// and DefaultRejoinMaxBackoff.
	RejoinInterval   time.Duration
	RejoinMaxBackoff time.Duration
	// ReconnectTimeout is how long Heal keeps contacting a known peer not
	// seen since. Default DefaultReconnectTimeout.
	ReconnectTimeout time.Duration
	// ConfirmTimeout bounds one QUIC confirmation of a peer that gossip
	// says is gone (see SetConfirmer); ConfirmInterval is how often a peer
	// that answered is asked again while gossip still says it is gone.
	// Defaults DefaultConfirmTimeout and DefaultConfirmInterval.
	ConfirmTimeout  time.Duration
	ConfirmInterval time.Duration
	// WrapTransport, when set, wraps memberlist's UDP/TCP transport (bound
	// on BindAddr as usual): fault injection in tests (partitions). Nil:
	// memberlist's own transport, unwrapped.
	WrapTransport func(memberlist.NodeAwareTransport) memberlist.NodeAwareTransport

	// Transport carries gossip instead of memberlist's UDP/TCP sockets on
	// BindAddr (which is then unused). Nil: the real network. Simulations
	// (mesh/meshsim) pass an in-memory one.
	Transport memberlist.Transport

	// Sink receives verified adverts and supplies ours. Nil: adverts are
	// verified and relayed but not delivered, and none are sent.
	Sink AdvertSink
	// Admission, when the sink's admission is this proxy, is bound to the
	// new Mesh before it starts gossip: the sink then judges the first
	// push/pull's adverts by it, instead of refusing them as unadmitted.
	Admission *AdmissionProxy
	// Audit records refusals. Nil discards them.
	Audit placement.AuditSink
	// Logger. Nil means zap.NewNop().
	Logger *zap.Logger
	// Now is the clock for admission (certificate expiry). Nil means
	// time.Now. Tests inject a clock. Advert bookkeeping uses the monotonic
	// clock.
	Now func() time.Time

	// backSpread, when set, replaces backSpread's window (tests: a spread
	// no test can wait out).
	backSpread time.Duration
}

// DefaultConfig returns the defaults (memberlist's LAN profile). StateDir
// must still be set.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		NodeName:            host,
		Cluster:             DefaultCluster,
		BindAddr:            DefaultBindAddr,
		AdvertTTL:           placement.DefaultAdvertTTL,
		GossipInterval:      200 * time.Millisecond,
		GossipNodes:         3,
		ProbeInterval:       time.Second,
		ProbeTimeout:        500 * time.Millisecond,
		PushPullInterval:    30 * time.Second,
		AntiEntropyInterval: time.Second,
		SuspicionMult:       4,
		RetransmitMult:      4,
		AdvertLoadBudget:    DefaultAdvertLoadBudget,
		TCPTimeout:          10 * time.Second,
		JoinBackoff:         DefaultJoinBackoff,
		JoinMaxBackoff:      DefaultJoinMaxBackoff,
		RejoinInterval:      DefaultRejoinInterval,
		RejoinMaxBackoff:    DefaultRejoinMaxBackoff,
		ReconnectTimeout:    DefaultReconnectTimeout,
		ConfirmTimeout:      DefaultConfirmTimeout,
		ConfirmInterval:     DefaultConfirmInterval,
	}
}

// withDefaults fills zero fields and validates; errors name the field.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	defaults.Zero(&c.NodeName, d.NodeName)
	defaults.Zero(&c.Cluster, d.Cluster)
	defaults.Zero(&c.BindAddr, d.BindAddr)
	defaults.Zero(&c.AdvertTTL, d.AdvertTTL)
	defaults.Zero(&c.GossipInterval, d.GossipInterval)
	defaults.Zero(&c.GossipNodes, d.GossipNodes)
	defaults.Zero(&c.ProbeInterval, d.ProbeInterval)
	defaults.Zero(&c.ProbeTimeout, d.ProbeTimeout)
	defaults.Zero(&c.PushPullInterval, d.PushPullInterval)
	defaults.Zero(&c.AntiEntropyInterval, d.AntiEntropyInterval)
	defaults.Zero(&c.TCPTimeout, d.TCPTimeout)
	defaults.Zero(&c.JoinBackoff, d.JoinBackoff)
	defaults.Zero(&c.JoinMaxBackoff, d.JoinMaxBackoff)
	defaults.Zero(&c.RejoinInterval, d.RejoinInterval)
	defaults.Zero(&c.RejoinMaxBackoff, d.RejoinMaxBackoff)
	defaults.Zero(&c.ReconnectTimeout, d.ReconnectTimeout)
	defaults.Zero(&c.ConfirmTimeout, d.ConfirmTimeout)
	defaults.Zero(&c.ConfirmInterval, d.ConfirmInterval)
	defaults.Zero(&c.SuspicionMult, d.SuspicionMult)
	defaults.Zero(&c.RetransmitMult, d.RetransmitMult)
	defaults.Zero(&c.AdvertLoadBudget, d.AdvertLoadBudget)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Now == nil {
		c.Now = time.Now
	}

	if err := identity.ValidateNodeName(c.NodeName); err != nil {
		return c, fmt.Errorf("NodeName: %w", err)
	}
	if c.StateDir == "" {
		return c, errors.New("StateDir: required")
	}
	defaults.Zero(&c.KeyFile, filepath.Join(c.StateDir, identity.NodeKeyFile))
	defaults.Zero(&c.KeyringPath, DefaultKeyringFile)
	if !filepath.IsAbs(c.KeyringPath) {
		c.KeyringPath = filepath.Join(c.StateDir, c.KeyringPath)
	}
	if len(c.Cluster) > maxClusterLen {
		return c, fmt.Errorf("Cluster: longer than %d bytes", maxClusterLen)
	}
	if _, _, err := splitHostPort(c.BindAddr); err != nil {
		return c, fmt.Errorf("BindAddr: %w", err)
	}
	if c.AdvertiseAddr != "" {
		if _, _, err := splitHostPort(c.AdvertiseAddr); err != nil {
			return c, fmt.Errorf("AdvertiseAddr: %w", err)
		}
	}
	if c.QUICAddr != "" {
		if len(c.QUICAddr) > maxQUICAddrLen {
			return c, fmt.Errorf("QUICAddr: longer than %d bytes", maxQUICAddrLen)
		}
		if _, _, err := splitHostPort(c.QUICAddr); err != nil {
			return c, fmt.Errorf("QUICAddr: %w", err)
		}
	}
	if err := nonNegative(
		namedDuration{"AdvertTTL", c.AdvertTTL}, namedDuration{"GossipInterval", c.GossipInterval},
		namedDuration{"ProbeInterval", c.ProbeInterval}, namedDuration{"ProbeTimeout", c.ProbeTimeout},
		namedDuration{"PushPullInterval", c.PushPullInterval}, namedDuration{"TCPTimeout", c.TCPTimeout},
		namedDuration{"AntiEntropyInterval", c.AntiEntropyInterval},
		namedDuration{"JoinBackoff", c.JoinBackoff}, namedDuration{"JoinMaxBackoff", c.JoinMaxBackoff},
		namedDuration{"RejoinInterval", c.RejoinInterval}, namedDuration{"RejoinMaxBackoff", c.RejoinMaxBackoff},
		namedDuration{"ReconnectTimeout", c.ReconnectTimeout},
		namedDuration{"ConfirmTimeout", c.ConfirmTimeout}, namedDuration{"ConfirmInterval", c.ConfirmInterval},
	); err != nil {
		return c, err
	}
	if c.SuspicionMult < 0 {
		return c, fmt.Errorf("SuspicionMult: negative")
	}
	if c.GossipNodes < 0 {
		return c, fmt.Errorf("GossipNodes: negative")
	}
	if c.AdvertLoadBudget < 0 {
		return c, fmt.Errorf("AdvertLoadBudget: negative")
	}
	if c.RetransmitMult < 0 {
		return c, fmt.Errorf("RetransmitMult: negative")
	}
	if c.GossipInterval > c.AdvertTTL/3 {
		return c, fmt.Errorf("GossipInterval: %v is longer than AdvertTTL/3 (%v)", c.GossipInterval, c.AdvertTTL/3)
	}
	return c, nil
}

// namedDuration is a duration field of a config, by name.
type namedDuration struct {
	name string
	d    time.Duration
}

// nonNegative names the first of ds that is negative. Defaults fill only
// zero fields, so it may run before or after them.
func nonNegative(ds ...namedDuration) error {
	for _, f := range ds {
		if f.d < 0 {
			return fmt.Errorf("%s: negative duration %v", f.name, f.d)
		}
	}
	return nil
}

func splitHostPort(s string) (string, int, error) {
	host, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("bad port in %q", s)
	}
	return host, port, nil
}
