package node

import (
	"context"
	"errors"
	"fmt"
	"strconv"
)

// SSHLease is an existing host: the lease is the host itself. Creating it
// acquires nothing; destroying it undoes what the bootstrap recorded it
// installed, over SSH, and nothing else.
type SSHLease struct {
	clients ClientFactory
	// Log receives the output of the removal commands (nil: dropped).
	Log func(node string, stream Stream, line string)
}

var _ Lease = (*SSHLease)(nil)

// NewSSHLease returns the ssh provider; clients connects to hosts for
// removal.
func NewSSHLease(clients ClientFactory) (*SSHLease, error) {
	if clients == nil {
		return nil, errors.New("ssh lease: no client factory")
	}
	return &SSHLease{clients: clients}, nil
}

// Kind is ssh.
func (l *SSHLease) Kind() Kind { return KindSSH }

func endpointOf(t *SSHTarget) Endpoint {
	return Endpoint{
		Host: t.Host, Port: t.Port, User: t.User,
		HostKeys: append([]string(nil), t.HostKeys...), Fingerprints: append([]string(nil), t.Fingerprints...),
	}
}

// Create returns the host as the lease, its endpoint known at once.
func (l *SSHLease) Create(_ context.Context, spec Spec) (LeaseFacts, *Endpoint, error) {
	if spec.Provider != KindSSH || spec.SSH == nil {
		return LeaseFacts{}, nil, fmt.Errorf("ssh lease: refusing a %q node spec", spec.Provider)
	}
	ep := endpointOf(spec.SSH)
	facts := LeaseFacts{
		Provider:   KindSSH,
		ID:         LeaseID("ssh:" + ep.String()),
		ContractID: ep.String(),
		Metadata:   map[string]string{"ssh_host": ep.Host, "ssh_port": strconv.Itoa(ep.Port), "ssh_user": ep.User},
		HostKeys:   append([]string(nil), ep.HostKeys...),
	}
	return facts, &ep, nil
}

// LookupEndpoint returns the host's endpoint from the lease.
func (l *SSHLease) LookupEndpoint(_ context.Context, lease LeaseFacts) (Endpoint, bool, error) {
	host, port := lease.Metadata["ssh_host"], lease.Metadata["ssh_port"]
	p, err := strconv.Atoi(port)
	if host == "" || err != nil {
		return Endpoint{}, false, nil
	}
	return Endpoint{Host: host, Port: p, User: lease.Metadata["ssh_user"], HostKeys: append([]string(nil), lease.HostKeys...)}, true, nil
}

// Destroy connects to the host (its key verified against the pins) and
// undoes what the handle records as installed. Nothing recorded: nothing
// to do, and no connection.
func (l *SSHLease) Destroy(ctx context.Context, h DestroyHandle) error {
	if h.Provider != KindSSH {
		return fmt.Errorf("ssh lease: refusing a %q destroy handle", h.Provider)
	}
	if len(h.Installed) == 0 {
		return nil
	}
	if h.Endpoint == nil {
		return fmt.Errorf("ssh lease %s: %d installed item(s) but no endpoint to remove them through", h.LeaseID, len(h.Installed))
	}
	ep := *h.Endpoint
	c := l.clients.ClientFor(SessionSpec{Node: h.Node, Lease: h.LeaseID, Endpoint: ep})
	defer c.Close()
	if err := c.Connect(ctx, ep, nil); err != nil {
		return fmt.Errorf("ssh %s: %w", ep, err)
	}
	var emit func(Stream, string)
	if l.Log != nil {
		emit = func(s Stream, line string) { l.Log(h.Node, s, line) }
	}
	if err := Uninstall(ctx, c, ep.User, h.Installed, emit); err != nil {
		return fmt.Errorf("remove from %s: %w", ep, err)
	}
	return nil
}
