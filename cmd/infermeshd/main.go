// Command infermeshd is the infermesh agent: it serves the loopback
// OpenAI-compatible proxy, takes part in the mesh, provisions local
// inference instances and answers the admin socket. This file is the thin
// outside of package agent: flags, the config file, logging, signals
// (SIGINT/SIGTERM cancel Run, SIGHUP reloads), sd_notify, and, for -dev,
// the built-in demo model as the agent's DevModel.
package main

import (
	"github.com/infermesh/infermesh/config"

	"context"
	"crypto/ed25519"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"

	"github.com/infermesh/infermesh/agent"
	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/identity"
)

// Exit codes, after sysexits(3). The unit's RestartPreventExitStatus
// lists the usage and config codes: restarting cannot fix either.
const (
	exitFailure = 1
	exitUsage   = 64 // EX_USAGE: a bad command line
	exitConfig  = 78 // EX_CONFIG: the config file cannot be read or is invalid
)

// exitError carries the exit code of a failure that has its own.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageError(err error) error  { return &exitError{exitUsage, err} }
func configError(err error) error { return &exitError{exitConfig, err} }

func main() {
	tuneGC()
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "infermeshd:", err)
		code := exitFailure
		var ee *exitError
		if errors.As(err, &ee) {
			code = ee.code
		}
		os.Exit(code)
	}
}

// options are the daemon's command line.
type options struct {
	configPath  string
	dev         bool
	devDelay    time.Duration
	devPort     int
	logLevel    string
	version     bool
	validate    bool
	keygen      bool
	resetState  bool
	newIdentity bool
}

// newFlags defines the command line. Every flag is in one of flagGroups
// (usage.go), which --help prints.
func newFlags() (*flag.FlagSet, *options) {
	var o options
	fs := flag.NewFlagSet("infermeshd", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // run reports errors and prints the usage itself
	fs.Usage = func() {}
	fs.StringVar(&o.configPath, "config", config.DefaultFile, "read the configuration from `FILE`")
	fs.BoolVar(&o.validate, "validate", false, "check --config (strict decoding, every field; with a mesh the gossip keyring; the admission certificate against trust.authority, node.name and the node key), print its warnings and exit: 0 when the agent would start with it, 78 when not")
	fs.StringVar(&o.logLevel, "log-level", "", "override log.level: debug, info, warn or error")
	fs.BoolVar(&o.keygen, "keygen", false, "create the node key in node.state_dir of --config unless it exists, print its public key and exit (node bootstrap runs this on the new host, so the private key never leaves it)")
	fs.BoolVar(&o.resetState, "reset-state", false, "start over with a state store that is damaged, gone or disagrees with its policy mirror: the damaged files are kept aside (*.bad-<time>) and the run-time overrides restored from the mirror when it verifies")
	fs.BoolVar(&o.newIdentity, "new-identity", false, "make a new node key where it is missing on a node that ran before (its peers must then trust the new public key)")
	fs.BoolVar(&o.dev, "dev", false, "development mode: one node, the built-in demo model as role chat on 127.0.0.1:18080, state in a temporary directory")
	fs.IntVar(&o.devPort, "dev-port", 18080, "dev mode: the loopback `PORT` of role chat")
	fs.DurationVar(&o.devDelay, "dev-token-delay", 30*time.Millisecond, "dev mode: the `DELAY` between streamed demo tokens")
	fs.BoolVar(&o.version, "version", false, "print the version and exit")
	return fs, &o
}

func run(args []string) error {
	fs, o := newFlags()
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			writeUsage(os.Stdout, fs)
			return err
		}
		return usageError(fmt.Errorf("%w (infermeshd --help lists the flags)", err))
	}
	if fs.NArg() > 0 {
		return usageError(fmt.Errorf("unexpected argument %q: every option is a flag (infermeshd --help lists them)", fs.Arg(0)))
	}
	if o.version {
		fmt.Println("infermeshd", agent.Version)
		return nil
	}
	if o.validate {
		if o.dev {
			return usageError(errors.New("--validate checks --config; --dev has no config file"))
		}
		return validateConfig(o.configPath)
	}

	if o.keygen {
		return printNodeKey(o.configPath)
	}

	var cfg *agent.Config
	var err error
	if o.dev {
		dir, err := os.MkdirTemp("", "infermesh-dev-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if cfg, err = agent.DevConfig(dir); err != nil {
			return err
		}
		chat := cfg.Roles["chat"]
		chat.Port = o.devPort
		cfg.Roles["chat"] = chat
		if err := cfg.Validate(); err != nil {
			return usageError(fmt.Errorf("--dev-port: %w", err))
		}
	} else {
		if cfg, err = agent.LoadConfig(o.configPath); err != nil {
			return configError(err)
		}
	}
	if o.logLevel != "" {
		cfg.Log.Level = o.logLevel
	}
	log, err := newLogger(cfg.Log, isTerminal(os.Stderr))
	if err != nil {
		return usageError(err)
	}
	defer func() { _ = log.Sync() }()

	// The built-in demo model: the simulated runtime's (answering at once)
	// and dev mode's (pacing its tokens).
	demo := func(delay time.Duration) agent.DevModel {
		return func(model string) (string, func(), error) {
			dcfg := demomodel.DefaultConfig()
			dcfg.Model = model
			dcfg.TokenDelay = delay
			dcfg.Logger = log.Named("demo")
			return demomodel.ServeLoopback(dcfg)
		}
	}
	// Listening sockets systemd kept across a restart are taken up again.
	fds := newFDStore(log, sdNotifyFDs)
	notify := func(state string) {
		if state == "READY=1" {
			fds.releaseUnused() // every listener is bound by now
		}
		sdNotify(state)
	}
	opts := agent.Options{Logger: log, Notify: notify, Listen: fds.listen, Simulated: demo(0), ResetState: o.resetState, NewIdentity: o.newIdentity}
	if o.dev {
		opts.DevModel = demo(o.devDelay)
		opts.OnAdminReady = func(socket string) {
			fmt.Fprintf(os.Stderr, "\nadmin socket: %s\n  export INFERMESH_SOCKET=%s\n", socket, socket)
		}
	}
	a, err := agent.New(cfg, opts)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// SIGHUP re-reads the config file and applies what can change at run
	// time; the result is logged (and audited by the agent).
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				if o.dev {
					log.Info("SIGHUP ignored in dev mode (no config file)")
					continue
				}
				res, err := a.Reload(ctx)
				if err != nil {
					log.Error("reload failed; the running config stays in force", zap.Error(err))
					continue
				}
				log.Info("reloaded", zap.Strings("applied", res.Applied), zap.Strings("needs_restart", res.NeedsRestart))
			}
		}
	}()
	if o.dev {
		go func() {
			// Print the try-it line once the role port is bound.
			for ctx.Err() == nil {
				if addr, ok := a.RoleAddr("chat"); ok {
					fmt.Fprintf(os.Stderr, "\ninfermesh dev node ready. Try:\n  curl -sN http://%s/v1/chat/completions -d '{\"model\":\"chat\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\n\n", addr)
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	if err := a.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		if fe := (*agent.FieldError)(nil); errors.As(err, &fe) {
			return configError(err) // what --validate refuses (the certificate)
		}
		return err
	}
	return nil
}

// validateConfig is --validate: the config loads, and its checks against
// the state dir pass (Preflight); the warnings go to stderr.
func validateConfig(path string) error {
	cfg, err := agent.LoadConfig(path)
	if err != nil {
		return configError(err)
	}
	warnings, err := cfg.Preflight(time.Now())
	if err != nil {
		return configError(fmt.Errorf("config %s: %w", path, err))
	}
	for _, w := range warnings {
		fmt.Fprintln(os.Stderr, "infermeshd: warning:", w)
	}
	more := ""
	switch len(warnings) {
	case 0:
	case 1:
		more = "; 1 warning on stderr"
	default:
		more = fmt.Sprintf("; %d warnings on stderr", len(warnings))
	}
	fmt.Printf("%s: valid (node %s, site %s, %d roles)%s\n", path, cfg.Node.Name, cfg.Site, len(cfg.Roles), more)
	return nil
}

// printNodeKey creates the node key of the config's state dir unless it
// exists and prints its public key.
func printNodeKey(configPath string) error {
	cfg, err := agent.LoadConfig(configPath)
	if err != nil {
		return configError(err)
	}
	key, _, err := identity.LoadOrCreateKey(filepath.Join(cfg.Node.StateDir, identity.NodeKeyFile))
	if err != nil {
		return err
	}
	fmt.Println(identity.EncodeNodeKey(key.Public().(ed25519.PublicKey)))
	return nil
}

// tuneGC trades heap for CPU unless the operator set GOGC or GOMEMLIMIT:
// the proxy's garbage is short-lived per-request data. On two shared cores,
// GOGC=400 against the default in three interleaved quick benches
// (make bench-quick with BENCH_COMPARE, 2026-11-30) gave +19%, +23% and -6%
// (within that run's spread) requests/s at c=64, and lower c=1 added p50 in
// two of the three. A soft memory limit keeps the larger heap target from
// growing unbounded: near it the collector runs as often as it must.
func tuneGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(1 << 30)
	}
}

// newLogger builds the logger of c. The console format colours levels
// only on a terminal (tty): journald and files get plain text.
func newLogger(c agent.LogConfig, tty bool) (*zap.Logger, error) {
	var zc zap.Config
	if c.Format == "console" {
		zc = zap.NewDevelopmentConfig()
		zc.EncoderConfig.EncodeLevel = zapcore.CapitalLevelEncoder
		if tty {
			zc.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
		}
	} else {
		zc = zap.NewProductionConfig()
		zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	}
	if c.Level != "" {
		lvl, err := zapcore.ParseLevel(c.Level)
		if err != nil {
			return nil, fmt.Errorf("log.level: %w", err)
		}
		zc.Level = zap.NewAtomicLevelAt(lvl)
	} else if c.Format == "console" {
		zc.Level = zap.NewAtomicLevelAt(zap.InfoLevel)
	}
	zc.DisableStacktrace = true
	s := zc.Sampling
	if s == nil {
		return zc.Build()
	}
	zc.Sampling = nil
	return zc.Build(zap.WrapCore(samplingExceptAccess(*s)))
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
