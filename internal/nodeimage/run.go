package nodeimage

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/network"
	"github.com/docker/docker/pkg/stdcopy"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/crypto/ssh"
)

// HostKeyPath is where a node container's sshd reads its only host key.
const HostKeyPath = "/etc/ssh/ssh_host_ed25519_key"

// ContainerConfig returns the configuration of a node container of image
// tag: systemd as PID 1, unprivileged, /run and /run/lock on tmpfs, the
// host's cgroup tree read-only, stopped the way systemd shuts down. The
// caller adds name, labels, env and network.
func ContainerConfig(tag string) (*container.Config, *container.HostConfig) {
	cc := &container.Config{
		Image: tag,
		// systemd reads this to know it runs in a container.
		Env: []string{"container=docker"},
		// systemd shuts down cleanly on SIGRTMIN+3 (SIGTERM makes it
		// re-execute itself): docker stop stops every unit first.
		StopSignal: "SIGRTMIN+3",
	}
	hc := &container.HostConfig{
		Tmpfs:         map[string]string{"/run": "rw,mode=755", "/run/lock": "rw"},
		Binds:         []string{"/sys/fs/cgroup:/sys/fs/cgroup:ro"},
		RestartPolicy: container.RestartPolicy{Name: container.RestartPolicyDisabled},
		LogConfig:     container.LogConfig{Type: "json-file", Config: map[string]string{"max-size": "10m", "max-file": "2"}},
	}
	return cc, hc
}

// SeedFiles returns a tar archive, to be copied to "/" of a created node
// container before it starts, holding its SSH host key (hostKey, mode 0600,
// and its public half) and root's authorized_keys. The host key is then
// the only one sshd ever presents, so the creator pins it from the first
// byte.
func SeedFiles(hostKey ed25519.PrivateKey, authorized []ssh.PublicKey) ([]byte, error) {
	block, err := ssh.MarshalPrivateKey(hostKey, "infermesh node host key")
	if err != nil {
		return nil, fmt.Errorf("host key: %w", err)
	}
	pub, err := ssh.NewPublicKey(hostKey.Public())
	if err != nil {
		return nil, fmt.Errorf("host key: %w", err)
	}
	var auth strings.Builder
	for _, k := range authorized {
		auth.Write(ssh.MarshalAuthorizedKey(k))
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	entries := []struct {
		name string
		mode int64
		dir  bool
		data []byte
	}{
		{name: "etc/ssh/ssh_host_ed25519_key", mode: 0o600, data: pem.EncodeToMemory(block)},
		{name: "etc/ssh/ssh_host_ed25519_key.pub", mode: 0o644, data: ssh.MarshalAuthorizedKey(pub)},
		{name: "root/.ssh/", mode: 0o700, dir: true},
		{name: "root/.ssh/authorized_keys", mode: 0o600, data: []byte(auth.String())},
	}
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: e.mode, ModTime: now, Typeflag: tar.TypeReg, Size: int64(len(e.data))}
		if e.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// ContainerAPI is the part of the Docker client Boot, Exec and WaitReady
// use; *client.Client satisfies it.
type ContainerAPI interface {
	ContainerCreate(ctx context.Context, config *container.Config, hostConfig *container.HostConfig, networkingConfig *network.NetworkingConfig, platform *ocispec.Platform, containerName string) (container.CreateResponse, error)
	CopyToContainer(ctx context.Context, container, path string, content io.Reader, options container.CopyToContainerOptions) error
	ContainerStart(ctx context.Context, container string, options container.StartOptions) error
	ContainerExecCreate(ctx context.Context, container string, options container.ExecOptions) (container.ExecCreateResponse, error)
	ContainerExecAttach(ctx context.Context, execID string, config container.ExecAttachOptions) (types.HijackedResponse, error)
	ContainerExecInspect(ctx context.Context, execID string) (container.ExecInspect, error)
}

// BootOptions describe one node container for Boot.
type BootOptions struct {
	Tag     string
	Name    string
	Labels  map[string]string
	Env     []string
	Network string // "" is the engine's default bridge
	// HostKey is written before start (SeedFiles); required.
	HostKey ed25519.PrivateKey
	// AuthorizedKeys may log in as root.
	AuthorizedKeys []ssh.PublicKey
	// Binds are added to the container's bind mounts ("src:dst[:opts]"),
	// e.g. the Docker engine's socket.
	Binds []string
}

// Boot creates a node container, seeds its host key and authorized keys,
// and starts it. It returns the container id; the caller removes it.
func Boot(ctx context.Context, api ContainerAPI, o BootOptions) (string, error) {
	if len(o.HostKey) != ed25519.PrivateKeySize {
		return "", errors.New("boot node container: no host key")
	}
	cc, hc := ContainerConfig(o.Tag)
	cc.Labels = o.Labels
	cc.Env = append(cc.Env, o.Env...)
	hc.Binds = append(hc.Binds, o.Binds...)
	var nc *network.NetworkingConfig
	if o.Network != "" {
		hc.NetworkMode = container.NetworkMode(o.Network)
		nc = &network.NetworkingConfig{EndpointsConfig: map[string]*network.EndpointSettings{o.Network: {}}}
	}
	resp, err := api.ContainerCreate(ctx, cc, hc, nc, nil, o.Name)
	if err != nil {
		return "", fmt.Errorf("create node container %s: %w", o.Name, err)
	}
	seed, err := SeedFiles(o.HostKey, o.AuthorizedKeys)
	if err != nil {
		return resp.ID, err
	}
	if err := api.CopyToContainer(ctx, resp.ID, "/", bytes.NewReader(seed), container.CopyToContainerOptions{}); err != nil {
		return resp.ID, fmt.Errorf("seed node container %s: %w", o.Name, err)
	}
	if err := api.ContainerStart(ctx, resp.ID, container.StartOptions{}); err != nil {
		return resp.ID, fmt.Errorf("start node container %s: %w", o.Name, err)
	}
	return resp.ID, nil
}

// Exec runs argv in container id and returns its stdout, stderr and exit
// code.
func Exec(ctx context.Context, api ContainerAPI, id string, argv ...string) (stdout, stderr string, code int, err error) {
	ex, err := api.ContainerExecCreate(ctx, id, container.ExecOptions{Cmd: argv, AttachStdout: true, AttachStderr: true})
	if err != nil {
		return "", "", -1, fmt.Errorf("exec %v: %w", argv, err)
	}
	att, err := api.ContainerExecAttach(ctx, ex.ID, container.ExecAttachOptions{})
	if err != nil {
		return "", "", -1, fmt.Errorf("exec %v: %w", argv, err)
	}
	defer att.Close()
	var out, errb bytes.Buffer
	done := make(chan error, 1)
	go func() {
		_, err := stdcopy.StdCopy(&out, &errb, att.Reader)
		done <- err
	}()
	select {
	case err = <-done:
	case <-ctx.Done():
		att.Close()
		<-done
		return out.String(), errb.String(), -1, fmt.Errorf("exec %v: %w", argv, ctx.Err())
	}
	if err != nil {
		return out.String(), errb.String(), -1, fmt.Errorf("exec %v: %w", argv, err)
	}
	insp, err := api.ContainerExecInspect(ctx, ex.ID)
	if err != nil {
		return out.String(), errb.String(), -1, fmt.Errorf("exec %v: %w", argv, err)
	}
	return out.String(), errb.String(), insp.ExitCode, nil
}

// Ready is what WaitReady found.
type Ready struct {
	// State is what `systemctl is-system-running` said: running or
	// degraded.
	State string
	// Failed lists the failed units when degraded: the stated reason.
	Failed []string
}

// WaitReady waits until systemd in container id has finished booting
// (is-system-running answers running or degraded) and ssh.service is
// active, or ctx ends.
func WaitReady(ctx context.Context, api ContainerAPI, id string) (Ready, error) {
	var last string
	for {
		out, _, _, err := Exec(ctx, api, id, "systemctl", "is-system-running")
		state := strings.TrimSpace(out)
		if err == nil && (state == "running" || state == "degraded") {
			r := Ready{State: state}
			if state == "degraded" {
				failed, _, _, _ := Exec(ctx, api, id, "systemctl", "--failed", "--plain", "--no-legend", "--no-pager")
				for _, l := range strings.Split(strings.TrimSpace(failed), "\n") {
					if f := strings.Fields(l); len(f) > 0 {
						r.Failed = append(r.Failed, f[0])
					}
				}
			}
			sshState, _, _, err := Exec(ctx, api, id, "systemctl", "is-active", "ssh.service")
			if err == nil && strings.TrimSpace(sshState) == "active" {
				return r, nil
			}
			last = "ssh.service " + strings.TrimSpace(sshState)
		} else if err != nil {
			last = err.Error()
		} else {
			last = "system " + state
		}
		select {
		case <-ctx.Done():
			return Ready{}, fmt.Errorf("node container %.12s not ready (last: %s): %w", id, last, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
