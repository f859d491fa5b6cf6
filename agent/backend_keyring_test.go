package agent

import (
	"context"
	"errors"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testnet"
)

func TestKeyringThroughTheBackend(t *testing.T) {
	k1, _ := identity.NewGossipKey()
	k2, _ := identity.NewGossipKey()
	dir := t.TempDir()
	m := newFakeMesh(k1)
	aa := startAdminAgent(t, adminConfigFile(t, dir, basePolicy, testnet.TCPPort(t, "127.0.0.1")), AdminOptions{Mesh: m})
	ctx := context.Background()
	kr, err := aa.client.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringInstall, Key: k2})
	if err != nil || len(kr.Keys) != 2 || kr.Members != 3 {
		t.Fatalf("install = %+v, %v", kr, err)
	}
	if _, err := aa.client.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringRemove, Key: k1}); !errors.Is(err, admin.ErrConflict) {
		t.Errorf("removing the primary = %v, want ErrConflict", err)
	}
	if _, err := aa.client.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringUse, Key: "not a key"}); !errors.Is(err, admin.ErrInvalid) {
		t.Errorf("use of garbage = %v, want ErrInvalid", err)
	}
	// Rotate: use the new key (by fingerprint), remove the old.
	if _, err := aa.client.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringUse, Key: kr.Keys[1].Fingerprint}); err != nil {
		t.Fatal(err)
	}
	kr, err = aa.client.ChangeKeyring(ctx, admin.KeyringChange{Op: admin.KeyringRemove, Key: k1})
	if err != nil || len(kr.Keys) != 1 || kr.Keys[0].Key != k2 || !kr.Keys[0].Primary {
		t.Errorf("after rotation = %+v, %v; want only %s, primary", kr, err, k2)
	}
}
