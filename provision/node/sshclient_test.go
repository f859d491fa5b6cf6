package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/testing/testnet"
)

// TestSSHConnectNamesItsCause: a Connect that gives up says why, at the
// stage of its cause, and reports every attempt it makes again (the
// operator sees a dial that keeps failing as it happens): a closed port
// is ssh_unreachable, "connection refused"; a port that accepts and never
// speaks SSH is ssh_timeout; a malformed pin is refused before any dial.
func TestSSHConnectNamesItsCause(t *testing.T) {
	signer := newSigner(t)
	pin := []string{AuthorizedKey(newSigner(t).PublicKey())}

	t.Run("closed port", func(t *testing.T) {
		port := testnet.TCPPort(t, "127.0.0.1") // free: nothing listens
		c := NewSSHClient(SSHConfig{Signer: signer, ConnectTimeout: 2 * time.Second})
		defer c.Close()
		var mu sync.Mutex
		var retries []ConnectRetry
		err := c.Connect(context.Background(), Endpoint{Host: "127.0.0.1", Port: port, User: "root", HostKeys: pin}, func(r ConnectRetry) {
			mu.Lock()
			retries = append(retries, r)
			mu.Unlock()
		})
		var ce *ConnectError
		if !errors.As(err, &ce) || ce.Stage != StageSSHUnreachable {
			t.Fatalf("Connect to a closed port = %v, want a ConnectError at %s", err, StageSSHUnreachable)
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if want := addr + ": connection refused, " + fmt.Sprint(ce.Attempts) + " attempt(s) in 2s (is sshd listening there?)"; err.Error() != want {
			t.Errorf("error = %q, want %q", err, want)
		}
		if len(retries) < 2 || len(retries) != ce.Attempts-1 {
			t.Fatalf("%d retries reported for %d attempts, want every attempt but the last", len(retries), ce.Attempts)
		}
		for i, r := range retries {
			if r.Attempt != i+1 || r.Next <= 0 || !strings.HasPrefix(r.String(), fmt.Sprintf("attempt %d failed: connection refused; next in ", i+1)) {
				t.Errorf("retry %d = %q (attempt %d, next %v)", i, r, r.Attempt, r.Next)
			}
		}
	})

	t.Run("silent port", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var held []net.Conn
		var mu sync.Mutex
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				conn, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				held = append(held, conn) // accepted, never answered
				mu.Unlock()
			}
		}()
		defer func() {
			ln.Close()
			<-done
			mu.Lock()
			for _, c := range held {
				c.Close()
			}
			mu.Unlock()
		}()
		port := ln.Addr().(*net.TCPAddr).Port
		c := NewSSHClient(SSHConfig{Signer: signer, HandshakeTimeout: 300 * time.Millisecond, ConnectTimeout: 1500 * time.Millisecond})
		defer c.Close()
		err = c.Connect(context.Background(), Endpoint{Host: "127.0.0.1", Port: port, User: "root", HostKeys: pin}, nil)
		var ce *ConnectError
		if !errors.As(err, &ce) || ce.Stage != StageSSHTimeout || !strings.Contains(err.Error(), "no SSH session: ssh handshake:") || !strings.Contains(err.Error(), "i/o timeout") {
			t.Errorf("Connect to a port that never speaks SSH = %v, want a ConnectError at %s naming the handshake timeout", err, StageSSHTimeout)
		}
	})

	t.Run("malformed pin", func(t *testing.T) {
		dialed := make(chan struct{}, 1)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			if conn, err := ln.Accept(); err == nil {
				dialed <- struct{}{}
				conn.Close()
			}
		}()
		c := NewSSHClient(SSHConfig{Signer: signer, ConnectTimeout: time.Second})
		defer c.Close()
		err = c.Connect(context.Background(), Endpoint{Host: "127.0.0.1", Port: ln.Addr().(*net.TCPAddr).Port, User: "root", Fingerprints: []string{"SHA256:nope"}}, nil)
		if err == nil || !strings.Contains(err.Error(), "want SHA256: followed by 43 base64 characters") {
			t.Errorf("Connect with a malformed fingerprint = %v, want the expected form named", err)
		}
		select {
		case <-dialed:
			t.Error("a malformed pin was dialled")
		default:
		}
	})
}

// TestSpecRefusesMalformedPins: a spec whose pins cannot match anything is
// invalid, so an add with one is refused before its lease exists.
func TestSpecRefusesMalformedPins(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*SSHTarget)
		want string
	}{
		{"no prefix", func(t *SSHTarget) { t.Fingerprints = []string{"AAAA"} }, `host key fingerprint "AAAA": want SHA256: followed by 43 base64 characters`},
		{"short digest", func(t *SSHTarget) { t.Fingerprints = []string{"SHA256:abcd"} }, `host key fingerprint "SHA256:abcd" is not a SHA256 digest`},
		{"bad host key", func(t *SSHTarget) { t.Fingerprints = nil; t.HostKeys = []string{"ssh-ed25519 nope"} }, "pinned host key 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testSpec(KindSSH)
			tc.edit(s.SSH)
			if err := s.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate = %v, want %q", err, tc.want)
			}
		})
	}
	if err := testSpec(KindSSH).Validate(); err != nil {
		t.Errorf("the test's own ssh spec: %v", err)
	}
}
