package agent

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/infermesh/infermesh/agent/admin"
)

// TestConsoleInRealBrowser opens the web console of a three-node mesh in
// a real browser (Debian's chromium, headless, driven over the DevTools
// protocol): a accepts chat from b and c, which serve it. The page, reached
// through the URL `infermesh console` prints, shows the three nodes on the
// map and a's two arrows (to b, and to c as its failover); a request sent
// during the test appears in the recent list under its X-Request-Id, with
// how its candidate was chosen. A
// screenshot is saved under $TMPDIR as evidence.
func TestConsoleInRealBrowser(t *testing.T) {
	browser, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium is needed (.ci/run installs it): ", err)
	}
	tm := newTestMesh(t, "a", "b", "c")
	tm.adminYAML = map[string]string{"a": "console: 127.0.0.1:0, "}
	ub, uc := startUpstream(t, "model-b", 0), startUpstream(t, "model-c", 0)
	a := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b", "c"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: ub, model: "model-b", expose: true, serveTo: []string{"a"}}}, false)
	tm.start("c", map[string]roleSpec{"chat": {upstream: uc, model: "model-c", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(t, "a resolves chat to b and c", func() bool { return a.resolvesTo("chat", "b", "c") })

	ac := admin.NewClient(a.agent.admin.SocketPath(), admin.ClientOptions{Wait: 10 * time.Second})
	defer ac.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ci, err := ac.Console(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(ci.TokenFile); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file %s: %v, %v; want mode 0600", ci.TokenFile, st, err)
	}
	if !strings.HasPrefix(ci.URL, "http://127.0.0.1:") || !strings.Contains(ci.URL, "?token=") {
		t.Fatalf("console URL %q", ci.URL)
	}

	actx, acancel := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 1400))...)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()
	if err := chromedp.Do(bctx, chromedp.Navigate(ci.URL)); err != nil {
		t.Fatalf("opening the console: %v", err)
	}
	if loc, err := chromedp.Run(bctx, chromedp.Location()); err != nil || strings.Contains(loc, "token=") {
		t.Fatalf("the page stayed at %q (%v), want the URL without the token", loc, err)
	}
	poll := func(what, expr string) {
		t.Helper()
		if _, err := chromedp.Run(bctx, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(time.Minute))); err != nil {
			t.Fatalf("the page never showed %s: %v", what, err)
		}
	}
	poll("the three nodes and a's two arrows", `document.querySelectorAll('#map-svg g.node').length === 3 &&
		document.querySelector('#map-svg path.arrow[data-from="a"][data-to="b"][data-role="chat"]') !== null &&
		document.querySelector('#map-svg path.arrow[data-from="a"][data-to="c"][data-role="chat"]') !== null`)

	id := fmt.Sprintf("console-test-%d", time.Now().UnixNano())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.url("chat")+"/v1/chat/completions",
		strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("chat through a = %d", resp.StatusCode)
	}
	// Its route: policy local-first (the mesh tests' default), b first by
	// its order.
	poll("the request in the recent list, with its route", fmt.Sprintf(`(() => { const r = document.querySelector('#requests tr[data-id=%q]');
		return r !== null && r.textContent.includes('chat') && r.textContent.includes('200') &&
			r.querySelector('td.route').textContent === 'order' && r.querySelector('td.route').title.startsWith('local-first, key none: b not estimated; c not estimated'); })()`, id))

	// The roles table: chat's queue here, and no cache hit ratio (a has
	// no instance of its own).
	poll("chat's row in the roles table, with its queue and cache hit cells", `(() => { const r = document.querySelector('#roles tr[data-role="chat"]');
		return r !== null && r.querySelector('td.queue').textContent === '0' && r.querySelector('td.cache-hit').textContent === '-'; })()`)

	shot, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(os.TempDir(), "infermesh-console.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(shot))
}
