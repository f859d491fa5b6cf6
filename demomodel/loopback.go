package demomodel

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"
)

// ServeLoopback serves a demo model configured by cfg on an ephemeral
// 127.0.0.1 port: the upstream of infermeshd's dev mode and of tests. It
// returns the base URL ("http://127.0.0.1:<port>") and stop, which shuts
// the server down (in-flight requests get up to 5s, then are cut) and
// waits for the one goroutine ServeLoopback started.
func ServeLoopback(cfg Config) (base string, stop func(), err error) {
	srv, err := New(cfg)
	if err != nil {
		return "", nil, fmt.Errorf("demo model: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, fmt.Errorf("demo model: %w", err)
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = hs.Serve(ln)
	}()
	return "http://" + ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if hs.Shutdown(ctx) != nil {
			_ = hs.Close()
		}
		<-done
	}, nil
}
