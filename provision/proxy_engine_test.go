package provision

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/proxy"
)

// The whole local path: a managed container, registered in placement by the
// Manager, reached by an app through the role's loopback proxy listener.
func TestManagerChatCompletionThroughLoopbackProxy(t *testing.T) {
	t.Parallel()
	e := newMgrEnv(t, engineSite(t), "", nil)
	px, err := proxy.New(proxy.Config{Resolver: e.table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		px.Shutdown(ctx)
	})
	addr, err := px.Listen("chat", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}

	e.apply(map[string]InstanceSpec{"chat": instanceSpec("m-chat")})
	e.waitReady("chat", nil)

	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	body := `{"model":"m-chat","messages":[{"role":"user","content":"hello"}]}`
	resp, err := c.Post("http://"+addr.String()+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("chat completion through the proxy: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"choices"`) || !strings.Contains(string(b), "m-chat") {
		t.Fatalf("chat completion through the proxy = %d %s, want 200 from m-chat", resp.StatusCode, b)
	}
}
