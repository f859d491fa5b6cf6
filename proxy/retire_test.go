package proxy

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/placement"
)

// TestRetireDrainsOneListener: a retired listener finishes the stream in
// flight on it and accepts nothing more, while the other role's listener
// serves on; the role may
// listen again at once, on another address. Both servers.
func TestRetireDrainsOneListener(t *testing.T) {
	for _, server := range []string{ServerInfermesh, ServerStd} {
		t.Run(server, func(t *testing.T) {
			table, _ := placement.New(placement.Config{NodeID: "a"})
			cfg := demomodel.DefaultConfig()
			cfg.TokenDelay = 20 * time.Millisecond
			cfg.Tokens = 10
			d, _ := demomodel.New(cfg)
			up := httptest.NewServer(d)
			defer up.Close()
			for _, role := range []string{"chat", "embed"} {
				_ = table.RegisterLocal(role, placement.Local{Base: up.URL, Model: cfg.Model})
			}
			p, err := New(Config{Resolver: table, Server: server})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Shutdown(context.Background())
			chat, err := p.Listen("chat", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			embed, err := p.Listen("embed", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			post := func(addr net.Addr, role string, stream bool) (*http.Response, error) {
				body := `{"model":"` + role + `","messages":[{"role":"user","content":"hi"}]}`
				if stream {
					body = `{"model":"` + role + `","stream":true,"messages":[{"role":"user","content":"hi"}]}`
				}
				c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
				return c.Post("http://"+addr.String()+pathChat, "application/json", strings.NewReader(body))
			}
			resp, err := post(chat, "chat", true)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()

			drain, ok := p.Retire("chat")
			if !ok {
				t.Fatal("Retire(chat) found no listener")
			}
			if _, ok := p.Addr("chat"); ok {
				t.Error("a retired listener is still the role's")
			}
			drained := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				drained <- drain(ctx)
			}()
			again, err := p.Listen("chat", "127.0.0.1:0")
			if err != nil {
				t.Fatalf("Listen of the retired role: %v", err)
			}
			raw, err := io.ReadAll(resp.Body)
			if err != nil || !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
				t.Errorf("stream on the retired listener: err %v, tail %q; want it whole", err, tail(raw))
			}
			if err := <-drained; err != nil {
				t.Errorf("drain: %v", err)
			}
			if c, err := net.DialTimeout("tcp", chat.String(), time.Second); err == nil {
				c.Close()
				t.Error("the retired listener still accepts connections")
			}
			for _, l := range []struct {
				addr net.Addr
				role string
			}{{embed, "embed"}, {again, "chat"}} {
				r, err := post(l.addr, l.role, false)
				if err != nil {
					t.Fatalf("%s on %s: %v", l.role, l.addr, err)
				}
				_, _ = io.Copy(io.Discard, r.Body)
				r.Body.Close()
				if r.StatusCode != http.StatusOK {
					t.Errorf("%s on %s: %d, want 200", l.role, l.addr, r.StatusCode)
				}
			}
			if _, ok := p.Retire("nothing"); ok {
				t.Error("Retire of a role without a listener reported one")
			}
		})
	}
}
