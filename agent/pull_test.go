package agent

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
)

// TestInstancesPullOverTheSocket: `instances pull` over the admin socket
// against the real engine: an image on the host is reported ready without
// a pull; one that no registry has (none answers here) streams the pull's
// start, then ends with one error saying what to do; a role without a
// docker instance is refused by name.
func TestInstancesPullOverTheSocket(t *testing.T) {
	if testing.Short() {
		t.Skip("uses the Docker engine; skipped in -short mode only")
	}
	const image = "infermesh-demo:agent-test"
	_, site := dockerSite(t, "agent-pull", image)
	const missing = "infermesh-ux-pull-missing:none"
	dir := t.TempDir()
	cfg, err := ParseConfig([]byte("node: {name: n1, state_dir: " + dir + "}\nsite: " + site + "\nadmin: {socket: " + dir + "/admin.sock}\nroles:\n" +
		"  chat: {port: 1, model: demo, instance: {image: '" + image + "', port: 8080}}\n" +
		"  gone: {port: 2, model: demo, instance: {image: '" + missing + "', port: 8080}}\n" +
		"  static: {port: 3, upstream: 'http://127.0.0.1:9'}\n"))
	if err != nil {
		t.Fatal(err)
	}
	for name, r := range cfg.Roles {
		r.Port = 0
		cfg.Roles[name] = r
	}
	a := runAgent(t, cfg, Options{})
	waitFor(t, "the admin socket", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.admin != nil && a.prov != nil
	})
	c := admin.NewClient(cfg.Admin.Socket, admin.ClientOptions{})
	pull := func(role string) ([]admin.NodeEvent, error) {
		var evs []admin.NodeEvent
		err := c.PullInstance(context.Background(), role, func(e admin.NodeEvent) error {
			evs = append(evs, e)
			return nil
		})
		return evs, err
	}

	evs, err := pull("chat")
	if err != nil || len(evs) != 2 || evs[0].Line != "image "+image+" is already on this host" || evs[1].Kind != admin.NodeEventDone {
		t.Errorf("pull chat = %+v, %v; want the image reported present, then done", evs, err)
	}

	evs, err = pull("gone")
	var failed *admin.NodeFailedError
	if !errors.As(err, &failed) || !strings.Contains(failed.Message, "docker pull "+missing) || !strings.Contains(failed.Message, "image not found") {
		t.Errorf("pull gone = %v, want one error saying docker pull %s or build it", err, missing)
	}
	if len(evs) == 0 || !strings.Contains(evs[0].Line, "is not on this host: pulling it") {
		t.Errorf("pull gone streamed %+v, want the pull's start first", evs)
	}

	if _, err := pull("static"); !errors.Is(err, admin.ErrNotFound) {
		t.Errorf("pull of a role without an instance = %v, want ErrNotFound", err)
	}
	if _, err := pull("nosuch"); !errors.Is(err, admin.ErrNotFound) {
		t.Errorf("pull of an unknown role = %v, want ErrNotFound", err)
	}
}
