package agent

import (
	"context"
	"io"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/placement"
)

// LocalRegistry is the part of the placement table an instance prober
// drives. Safe for concurrent use.
type LocalRegistry interface {
	RegisterLocal(role string, l placement.Local) error
	DeregisterLocal(role string)
}

// upstreamProber keeps a static upstream registered in placement only while
// it answers: llama.cpp's /health first, then /v1/models for servers without
// one. A server still loading its model (503) counts as down. Its first
// probe decides the role's registration whatever another prober left
// there (a reload replaces a role's upstream), and while the upstream
// answers each probe registers it again (a no-op when nothing changed), so
// that the instance manager forgetting the role's managed instance, which
// the reload also replaced, cannot take the role away.
type upstreamProber struct {
	role     string
	local    placement.Local
	reg      LocalRegistry
	client   *http.Client
	interval time.Duration
	log      *zap.Logger
	// key is the instance's API key (upstream_api_key_file), "" for none:
	// servers such as LiteLLM require it on their health path too.
	key func() string
}

func (u *upstreamProber) run(ctx context.Context) {
	t := time.NewTicker(u.interval)
	defer t.Stop()
	up, first := false, true
	for {
		now := u.probe(ctx)
		if ctx.Err() != nil {
			return
		}
		switch {
		case now:
			if err := u.reg.RegisterLocal(u.role, u.local); err != nil {
				if up || first {
					u.log.Error("registering local instance", zap.String("role", u.role), zap.Error(err))
				}
				now = false
			} else if !up {
				u.log.Info("local instance up", zap.String("role", u.role), zap.String("upstream", u.local.Base))
			}
		case up || first:
			u.reg.DeregisterLocal(u.role)
			if up {
				u.log.Warn("local instance down", zap.String("role", u.role), zap.String("upstream", u.local.Base))
			}
		}
		up, first = now, false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (u *upstreamProber) probe(ctx context.Context) bool {
	st := u.get(ctx, "/health")
	if st == http.StatusNotFound {
		st = u.get(ctx, "/v1/models")
	}
	return st == http.StatusOK
}

func (u *upstreamProber) get(ctx context.Context, path string) int {
	ctx, cancel := context.WithTimeout(ctx, u.interval+time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.local.Base+path, nil)
	if err != nil {
		return 0
	}
	if u.key != nil {
		if k := u.key(); k != "" {
			req.Header.Set("Authorization", "Bearer "+k)
		}
	}
	resp, err := u.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	return resp.StatusCode
}
