package agent

import (
	"context"
	"errors"
	"testing"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/internal/testing/testnet"
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
	raw, _ := identity.ParseGossipKey(k2)
	fp2 := identity.GossipKeyFingerprint(raw).String()
	// The answer names the keys by fingerprint; the key itself only when
	// asked for.
	if err != nil || len(kr.Keys) != 1 || kr.Keys[0].Fingerprint != fp2 || kr.Keys[0].Key != "" || !kr.Keys[0].Primary {
		t.Errorf("after rotation = %+v, %v; want only %s (by fingerprint), primary", kr, err, fp2)
	}
	if kr, err = aa.client.KeyringSecrets(ctx); err != nil || len(kr.Keys) != 1 || kr.Keys[0].Key != k2 {
		t.Errorf("keyring with its secrets = %+v, %v; want %s", kr, err, k2)
	}
}
