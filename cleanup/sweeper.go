package cleanup

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/internal/ctxwait"
	"github.com/infermesh/infermesh/internal/defaults"
)

// SweeperConfig configures the agent's orphan sweep. Zero values mean the
// default.
type SweeperConfig struct {
	// Cleanup is the site cleanup selected for the agent's configuration
	// (required).
	Cleanup *SiteCleanup
	// Site is the agent's site and Node its node (required): the sweep's
	// scope is targets <Node>, so other nodes' resources on this host are
	// never touched.
	Site string
	Node string
	// Wanted returns the refs still wanted: the refs of the durable
	// intents and of the running instances (required). It is asked when
	// resources are classified and again just before each removal. An
	// error keeps everything.
	Wanted func() (map[string]bool, error)
	// Grace is how young a resource may be and still be kept although
	// nothing wants it: it may be being created. Default 2m.
	Grace time.Duration
	// Interval between sweeps once one succeeded. Default 10m.
	Interval time.Duration
	// RetryBackoff is the first wait after a sweep that failed or skipped
	// a runtime; it doubles up to Interval until a sweep succeeds.
	// Default 5s.
	RetryBackoff time.Duration
	// Logger; nil means zap.NewNop().
	Logger *zap.Logger
	// OnSweep is told the outcome of every sweep (nil: nothing). It must
	// not block.
	OnSweep func(Report, error)
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// DefaultSweeperConfig returns the defaults (the required fields unset).
func DefaultSweeperConfig() SweeperConfig {
	return SweeperConfig{Grace: 2 * time.Minute, Interval: 10 * time.Minute, RetryBackoff: 5 * time.Second}
}

// Sweeper is the agent's periodic orphan sweep: the site cleanup of the
// agent's own execution target, keeping whatever the agent still wants and
// whatever is younger than the grace period. It is the same code as a
// stopped-site cleanup, so the same classification, fail-closed rules and
// re-checks apply.
type Sweeper struct {
	cfg   SweeperConfig
	scope Scope

	mu        sync.Mutex
	succeeded bool
}

// NewSweeper validates cfg.
func NewSweeper(cfg SweeperConfig) (*Sweeper, error) {
	if cfg.Cleanup == nil {
		return nil, errors.New("sweeper config: Cleanup is nil")
	}
	if cfg.Wanted == nil {
		return nil, errors.New("sweeper config: Wanted is nil")
	}
	scope, err := TargetScope(cfg.Node)
	if err != nil {
		return nil, err
	}
	d := DefaultSweeperConfig()
	defaults.Positive(&cfg.Grace, d.Grace)
	defaults.Positive(&cfg.Interval, d.Interval)
	defaults.Positive(&cfg.RetryBackoff, d.RetryBackoff)
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.OnSweep == nil {
		cfg.OnSweep = func(Report, error) {}
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Sweeper{cfg: cfg, scope: scope}, nil
}

// Succeeded reports whether a sweep has succeeded (no error, no runtime
// skipped) since the sweeper was made.
func (s *Sweeper) Succeeded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.succeeded
}

// Run sweeps at once, then again with a doubling backoff until a sweep
// succeeds, then every Interval, until ctx is done.
func (s *Sweeper) Run(ctx context.Context) {
	backoff := s.cfg.RetryBackoff
	for {
		rep, err := s.Sweep(ctx)
		if ctx.Err() != nil {
			return
		}
		wait := s.cfg.Interval
		if err != nil || len(rep.Skipped) > 0 {
			if !s.Succeeded() {
				wait = backoff
				backoff = min(backoff*2, s.cfg.Interval)
			}
		}
		if !ctxwait.Sleep(ctx, wait) {
			return
		}
	}
}

// Sweep removes, once, the agent's resources nothing wants.
func (s *Sweeper) Sweep(ctx context.Context) (Report, error) {
	log := s.cfg.Logger
	keep := func(r Resource) bool {
		wanted, err := s.cfg.Wanted()
		if err != nil {
			log.Warn("orphan sweep: reading what is wanted; keeping everything", zap.Error(err))
			return true
		}
		if wanted[r.Ref] {
			return true
		}
		// An unknown creation time cannot be judged old enough.
		return r.Created.IsZero() || s.cfg.Now().Sub(r.Created) < s.cfg.Grace
	}
	rep, err := s.cfg.Cleanup.Sweep(ctx, s.cfg.Site, s.scope, keep)
	for _, r := range rep.Removed {
		log.Info("orphan removed", zap.String("runtime", r.Runtime), zap.String("resource", r.Description))
	}
	for _, sk := range rep.Skipped {
		log.Info("orphan sweep skipped an optional runtime", zap.String("runtime", sk.Runtime), zap.Error(sk.Reason))
	}
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("orphan sweep", zap.Error(err))
		}
	} else if len(rep.Skipped) == 0 {
		s.mu.Lock()
		s.succeeded = true
		s.mu.Unlock()
	}
	s.cfg.OnSweep(rep, err)
	return rep, err
}
