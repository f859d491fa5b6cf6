package mesh

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/infermesh/infermesh/identity"
)

// ErrPrimaryKey is returned when removing the primary gossip key.
var ErrPrimaryKey = errors.New("the primary gossip key cannot be removed")

// ErrKeyNotInstalled is returned when using or removing an unknown key.
var ErrKeyNotInstalled = errors.New("gossip key not installed")

// KeyStatus is one gossip key as ListKeys reports it.
type KeyStatus struct {
	Key         string               // base64
	Fingerprint identity.Fingerprint // the key's name in node meta, the admin API and the audit log
	Primary     bool                 // used to encrypt; the others only decrypt
	Nodes       int                  // live members (this one included) holding the key
}

// How long a keyring change waits for our new meta (the key fingerprints
// ListKeys counts) to start spreading.
const keyringUpdateTimeout = 5 * time.Second

// ListKeys returns the installed gossip keys, primary first, each with how
// many live members (this node included) hold it, and the number of live
// members. Other nodes report their keys in their node meta, so the counts
// follow gossip. A rotation is complete when a key's Nodes equals members.
func (m *Mesh) ListKeys() (keys []KeyStatus, members int) {
	installed := m.keyring.GetKeys()
	m.mu.RLock()
	counts := make(map[identity.Fingerprint]int, len(installed))
	for _, p := range m.peers {
		for _, fp := range p.meta.keyFPs {
			counts[fp]++
		}
	}
	members = len(m.peers) + 1
	m.mu.RUnlock()
	for i, k := range installed {
		fp := identity.GossipKeyFingerprint(k)
		keys = append(keys, KeyStatus{
			Key:         identity.EncodeGossipKey(k),
			Fingerprint: fp,
			Primary:     i == 0,
			Nodes:       counts[fp] + 1,
		})
	}
	return keys, members
}

// InstallKey adds a gossip key (text form) to the keyring, for decryption
// only until UseKey, and persists the keyring file. Installing a key that is
// already there does nothing.
func (m *Mesh) InstallKey(key string) error {
	k, err := identity.ParseGossipKey(key)
	if err != nil {
		return err
	}
	return m.changeKeyring("install", func() error {
		if m.hasKey(k) {
			return errUnchanged
		}
		if len(m.keyring.GetKeys()) >= identity.MaxGossipKeys {
			return fmt.Errorf("keyring already holds %d keys, the most allowed; remove one first", identity.MaxGossipKeys)
		}
		return m.keyring.AddKey(k)
	}, func() { _ = m.keyring.RemoveKey(k) })
}

// UseKey makes an installed key the primary (encrypting) key and persists
// the keyring file.
func (m *Mesh) UseKey(key string) error {
	k, err := identity.ParseGossipKey(key)
	if err != nil {
		return err
	}
	var old []byte
	return m.changeKeyring("use", func() error {
		if !m.hasKey(k) {
			return ErrKeyNotInstalled
		}
		old = m.keyring.GetPrimaryKey()
		if bytes.Equal(old, k) {
			return errUnchanged
		}
		return m.keyring.UseKey(k)
	}, func() { _ = m.keyring.UseKey(old) })
}

// RemoveKey removes a non-primary key from the keyring and persists the
// keyring file. The primary key returns ErrPrimaryKey.
func (m *Mesh) RemoveKey(key string) error {
	k, err := identity.ParseGossipKey(key)
	if err != nil {
		return err
	}
	return m.changeKeyring("remove", func() error {
		if !m.hasKey(k) {
			return ErrKeyNotInstalled
		}
		if bytes.Equal(m.keyring.GetPrimaryKey(), k) {
			return ErrPrimaryKey
		}
		return m.removeKeys(func(x []byte) bool { return bytes.Equal(x, k) })
	}, func() { _ = m.keyring.AddKey(k) })
}

// removeKeys removes the non-primary keys gone says go. memberlist's
// Keyring.RemoveKey shifts the keys after the one removed in place, in
// the array that GetKeys returned to memberlist's readers (which decrypt
// every packet with it, unlocked): so keys are only ever removed from the
// end. The keys from the first to go onward are removed last first, then
// those among them that stay are added back (each a fresh slice).
// keyringMu must be held.
func (m *Mesh) removeKeys(gone func([]byte) bool) error {
	keys := slices.Clone(m.keyring.GetKeys())
	first := slices.IndexFunc(keys[1:], gone) + 1
	if first == 0 {
		return nil
	}
	for i := len(keys) - 1; i >= first; i-- {
		if err := m.keyring.RemoveKey(keys[i]); err != nil {
			return err
		}
	}
	for _, k := range keys[first:] {
		if !gone(k) {
			if err := m.keyring.AddKey(k); err != nil {
				return err
			}
		}
	}
	return nil
}

// RetainKeys keeps only keys (text form; the primary must be one of them)
// in the keyring, removes every other key and persists the keyring file.
// Keys it lists that are not installed are ignored.
func (m *Mesh) RetainKeys(keys []string) error {
	keep := make([][]byte, 0, len(keys))
	for i, key := range keys {
		k, err := identity.ParseGossipKey(key)
		if err != nil {
			return fmt.Errorf("key %d: %w", i, err)
		}
		keep = append(keep, k)
	}
	var removed [][]byte
	kept := func(k []byte) bool {
		return slices.ContainsFunc(keep, func(x []byte) bool { return bytes.Equal(x, k) })
	}
	return m.changeKeyring("retain", func() error {
		if !kept(m.keyring.GetPrimaryKey()) {
			return fmt.Errorf("%w: the keys to keep do not include it", ErrPrimaryKey)
		}
		for _, k := range m.keyring.GetKeys() {
			if !kept(k) {
				removed = append(removed, k)
			}
		}
		if len(removed) == 0 {
			return errUnchanged
		}
		return m.removeKeys(func(k []byte) bool { return !kept(k) })
	}, func() {
		for _, k := range removed {
			_ = m.keyring.AddKey(k)
		}
	})
}

var errUnchanged = fmt.Errorf("unchanged")

func (m *Mesh) hasKey(k []byte) bool {
	return slices.ContainsFunc(m.keyring.GetKeys(), func(x []byte) bool { return bytes.Equal(x, k) })
}

// changeKeyring applies change, persists the keyring (undoing the change
// when that fails) and re-announces our meta. keyringMu serializes keyring
// changes with their file writes; nothing on a gossip path takes it.
func (m *Mesh) changeKeyring(op string, change func() error, undo func()) error {
	m.keyringMu.Lock()
	defer m.keyringMu.Unlock()
	if err := change(); err != nil {
		if err == errUnchanged {
			return nil
		}
		return fmt.Errorf("keyring %s: %w", op, err)
	}
	if err := identity.SaveKeyring(m.cfg.KeyringPath, m.keyring.GetKeys()); err != nil {
		undo()
		return fmt.Errorf("keyring %s: %w", op, err)
	}
	if err := m.rebuildMeta(); err != nil {
		return fmt.Errorf("keyring %s: node meta: %w", op, err)
	}
	if err := m.ml.UpdateNode(keyringUpdateTimeout); err != nil {
		m.log.Warn("keyring changed; announcing it is slow", zap.String("op", op), zap.Error(err))
	}
	m.log.Info("keyring changed", zap.String("op", op))
	return nil
}
