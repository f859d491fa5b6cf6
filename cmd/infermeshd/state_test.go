package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
	"github.com/infermesh/infermesh/store"
)

// startAgent runs infermeshd with args until its log says it is ready; it
// is stopped (SIGTERM) at cleanup. It returns the log so far.
func startAgent(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Stderr = &syncWriter{w: &strings.Builder{}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		}
	}
	t.Cleanup(stop)
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(logsString(cmd), "infermeshd ready") {
		if time.Now().After(deadline) {
			t.Fatalf("infermeshd %v never became ready:\n%s", args, logsString(cmd))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return cmd
}

// refused runs infermeshd with args and wants it to exit 1 (an error, not a
// crash) with an output that mentions each of wants.
func refused(t *testing.T, wants []string, args ...string) {
	t.Helper()
	out, err := exec.Command(bin, args...).CombinedOutput()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 1 {
		t.Fatalf("infermeshd %v: %v, want exit status 1\n%s", args, err, out)
	}
	if s := string(out); strings.Contains(s, "panic") || strings.Contains(s, "SIGBUS") {
		t.Errorf("infermeshd %v crashed:\n%s", args, s)
	}
	for _, w := range wants {
		if !strings.Contains(string(out), w) {
			t.Errorf("infermeshd %v: output %q, want it to mention %q", args, out, w)
		}
	}
}

// TestDamagedStateStoreRefusedUntilReset: a state store with a revocation,
// garbage over its newest meta page: infermeshd refuses to start, naming
// the file and -reset-state; with -reset-state it starts, the revocation
// restored from the policy mirror.
func TestDamagedStateStoreRefusedUntilReset(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	dbPath := filepath.Join(state, store.FileName)
	st, err := store.Open(dbPath, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Put(store.Override{Kind: store.KindRevoke, Node: "evil", On: true}); err != nil {
		t.Fatal(err)
	}
	st.Close()
	f, err := os.OpenFile(dbPath, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte(strings.Repeat("garbage!", 512)), 0)
	f.Close()

	cfg := filepath.Join(dir, "infermesh.yaml")
	port := testnet.TCPPort(t, "127.0.0.1")
	c := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nroles:\n  chat: {port: %d, upstream: 'http://127.0.0.1:9'}\n",
		state, filepath.Join(dir, "admin.sock"), port)
	if err := os.WriteFile(cfg, []byte(c), 0o600); err != nil {
		t.Fatal(err)
	}
	refused(t, []string{dbPath, "corrupt", "-reset-state"}, "-config", cfg)

	cmd := startAgent(t, "-config", cfg, "-reset-state")
	if s := logsString(cmd); !strings.Contains(s, "kept "+dbPath+" aside") {
		t.Errorf("the log does not say where the damaged store went:\n%s", s)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	cmd.Wait()
	st, err = store.Open(dbPath, store.Options{})
	if err != nil {
		t.Fatalf("the store after the reset: %v", err)
	}
	defer st.Close()
	if os, _ := st.Overrides(); len(os) != 1 || os[0].Node != "evil" {
		t.Errorf("overrides after the reset = %+v, want the revocation of evil", os)
	}
}

// TestMissingNodeKeyRefused: a node that ran before (its state store is
// there) without its node key does not quietly become a new identity.
func TestMissingNodeKeyRefused(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	st, err := store.Open(filepath.Join(state, store.FileName), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	keyring := filepath.Join(dir, "keyring.json")
	if _, err := identity.WriteNewKeyring(keyring); err != nil {
		t.Fatal(err)
	}
	ip := "127.0.0.1"
	cfg := filepath.Join(dir, "infermesh.yaml")
	c := fmt.Sprintf("node: {name: a, state_dir: %s}\nadmin: {socket: %s}\nmesh: {bind: '%s:%d', quic: '%s:%d', gossip_keyring: %s}\nroles:\n  chat: {port: %d, upstream: 'http://127.0.0.1:9'}\n",
		state, filepath.Join(dir, "admin.sock"), ip, testnet.TCPUDPPort(t, ip), ip, testnet.UDPPort(t, ip), keyring, testnet.TCPPort(t, ip))
	if err := os.WriteFile(cfg, []byte(c), 0o600); err != nil {
		t.Fatal(err)
	}
	keyPath := filepath.Join(state, identity.NodeKeyFile)
	refused(t, []string{keyPath, "-new-identity"}, "-config", cfg)
	if _, err := os.Stat(keyPath); err == nil {
		t.Error("the refused start made a node key")
	}
	startAgent(t, "-config", cfg, "-new-identity")
	if _, err := os.Stat(keyPath); err != nil {
		t.Errorf("-new-identity: %v", err)
	}
}
