package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/console"
	"github.com/infermesh/infermesh/identity"
)

// The web console (admin.console, off by default): package console serves
// it; the agent gives it its data (the admin backend's read side and the
// recent requests) and a token made at each start, kept in a 0600 file in
// the state dir, Jupyter-style, and handed to admin readers by GET
// /v0/console (`infermesh console`).

// ConsoleTokenFile is the token's file in the state dir.
const ConsoleTokenFile = "console.token"

// consoleSource is what the console reads.
type consoleSource struct {
	*Backend
}

func (s consoleSource) RecentRequests() []admin.RecentRequest { return s.a.RecentRequests() }

// startConsole binds the console, writes its token file and serves it
// until ad stops. Called from Serve with ad.mu held.
func (ad *Admin) startConsole(addr string) error {
	tok, err := console.NewToken()
	if err != nil {
		return fmt.Errorf("admin.console: a token: %w", err)
	}
	path := filepath.Join(ad.a.config().Node.StateDir, ConsoleTokenFile)
	if err := identity.WriteSecretFile(path, []byte(tok+"\n")); err != nil {
		return fmt.Errorf("admin.console: the token file: %w", err)
	}
	srv, err := console.New(console.Config{Listen: addr, Token: tok, Source: consoleSource{ad.backend}, Logger: ad.log.Named("console")})
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("admin.console: %w", err)
	}
	ad.console, ad.consoleToken = srv, path
	ad.wg.Add(1)
	go func() {
		defer ad.wg.Done()
		if err := srv.Serve(); err != nil {
			ad.log.Error("console stopped", zap.Error(err))
		}
	}()
	ad.log.Info("console listening", zap.String("addr", srv.Addr().String()), zap.String("token_file", path))
	return nil
}

// stopConsole ends the console and removes its token file: the next start
// makes a new one.
func (ad *Admin) stopConsole(ctx context.Context) {
	ad.mu.Lock()
	srv, path := ad.console, ad.consoleToken
	ad.mu.Unlock()
	if srv == nil {
		return
	}
	_ = srv.Shutdown(ctx)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		ad.log.Warn("console token file left", zap.Error(err))
	}
}

// Console implements admin.ConsoleBackend: the console's URL with its
// token.
func (b *Backend) Console(context.Context) (admin.ConsoleInfo, error) {
	b.a.mu.Lock()
	ad := b.a.admin
	b.a.mu.Unlock()
	if ad == nil {
		return admin.ConsoleInfo{}, admin.Errorf(admin.ErrNotConfigured, "the admin runtime is not running")
	}
	ad.mu.Lock()
	srv, path := ad.console, ad.consoleToken
	ad.mu.Unlock()
	if srv == nil {
		return admin.ConsoleInfo{}, admin.Errorf(admin.ErrNotConfigured, "the console is off: set admin.console to a loopback host:port (e.g. 127.0.0.1:8099) and restart the agent")
	}
	return admin.ConsoleInfo{URL: srv.URL(), TokenFile: path}, nil
}
