package mesh

import (
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/infermesh/infermesh/identity"
)

func TestConfigValidationNamesTheField(t *testing.T) {
	base := func() Config { return Config{NodeName: "a", StateDir: t.TempDir()} }
	tests := []struct {
		field string
		mod   func(*Config)
	}{
		{"NodeName", func(c *Config) { c.NodeName = "a b" }},
		{"StateDir", func(c *Config) { c.StateDir = "" }},
		{"BindAddr", func(c *Config) { c.BindAddr = "nohost" }},
		{"QUICAddr", func(c *Config) { c.QUICAddr = "x" }},
		{"Cluster", func(c *Config) { c.Cluster = strings.Repeat("c", 65) }},
		{"AdvertTTL", func(c *Config) { c.AdvertTTL = -1 }},
		{"GossipInterval", func(c *Config) { c.AdvertTTL = time.Second; c.GossipInterval = time.Second }},
		{"Trust.Nodes[0]", func(c *Config) { c.Trust.Nodes = []TrustedNode{{Name: "x"}} }},
		{"Certificate", func(c *Config) { c.Certificate = "garbage" }},
	}
	for _, tt := range tests {
		t.Run(tt.field, func(t *testing.T) {
			c := base()
			tt.mod(&c)
			_, err := New(c)
			if err == nil || !strings.Contains(err.Error(), tt.field) {
				t.Errorf("New = %v, want an error naming %s", err, tt.field)
			}
		})
	}
	// A missing keyring is an error, with a hint.
	if _, err := New(base()); err == nil || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("New without keyring = %v, want fs.ErrNotExist", err)
	}
}

// TestDefaultsFillOnlyZeroFields: every zero field gets DefaultConfig's
// value (and DefaultTransportConfig's), a set field is kept, and a negative
// duration is an error naming the first such field.
func TestDefaultsFillOnlyZeroFields(t *testing.T) {
	c, err := Config{NodeName: "a", StateDir: "/s", ProbeTimeout: time.Second}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	d := DefaultConfig()
	if c.Cluster != d.Cluster || c.BindAddr != d.BindAddr || c.AdvertTTL != d.AdvertTTL ||
		c.GossipInterval != d.GossipInterval || c.ProbeInterval != d.ProbeInterval ||
		c.PushPullInterval != d.PushPullInterval || c.TCPTimeout != d.TCPTimeout ||
		c.JoinBackoff != d.JoinBackoff || c.JoinMaxBackoff != d.JoinMaxBackoff ||
		c.SuspicionMult != d.SuspicionMult || c.RetransmitMult != d.RetransmitMult ||
		c.Logger == nil || c.Now == nil {
		t.Errorf("defaults not filled: %+v", c)
	}
	if c.NodeName != "a" || c.ProbeTimeout != time.Second {
		t.Errorf("set fields changed: NodeName %q ProbeTimeout %v", c.NodeName, c.ProbeTimeout)
	}
	if c.KeyFile != "/s/"+identity.NodeKeyFile || c.KeyringPath != "/s/"+DefaultKeyringFile {
		t.Errorf("KeyFile, KeyringPath = %s, %s; want them in the state dir", c.KeyFile, c.KeyringPath)
	}
	_, err = Config{NodeName: "a", StateDir: "/s", TCPTimeout: -1, JoinBackoff: -1}.withDefaults()
	if err == nil || !strings.HasPrefix(err.Error(), "TCPTimeout: negative") {
		t.Errorf("two negative durations: %v, want the first (TCPTimeout) named", err)
	}

	tc := DefaultTransportConfig()
	got, err := TransportConfig{Name: "a", Key: make([]byte, 64), Listen: "127.0.0.1:0", Peers: NewStaticDirectory(), MaxIdleTimeout: time.Minute}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if got.HandshakeTimeout != tc.HandshakeTimeout || got.KeepAlivePeriod != tc.KeepAlivePeriod ||
		got.RecheckInterval != tc.RecheckInterval || got.MaxStreamsPerPeer != tc.MaxStreamsPerPeer ||
		got.MaxConnsPerPeer != tc.MaxConnsPerPeer || got.BodyTimeout != tc.BodyTimeout || got.Logger == nil {
		t.Errorf("transport defaults not filled: %+v", got)
	}
	if got.MaxIdleTimeout != time.Minute {
		t.Errorf("MaxIdleTimeout = %v, want the set minute kept", got.MaxIdleTimeout)
	}
	for _, tt := range []struct {
		field string
		mod   func(*TransportConfig)
	}{
		{"KeepAlivePeriod", func(c *TransportConfig) { c.KeepAlivePeriod = -1 }},
		{"RecheckInterval", func(c *TransportConfig) { c.RecheckInterval = -1 }},
		{"MaxStreamsPerPeer", func(c *TransportConfig) { c.MaxStreamsPerPeer = -1 }},
		{"MaxConnsPerPeer", func(c *TransportConfig) { c.MaxConnsPerPeer = -1 }},
		{"BodyTimeout", func(c *TransportConfig) { c.BodyTimeout = -1 }},
	} {
		c := TransportConfig{Name: "a", Key: make([]byte, 64), Listen: "127.0.0.1:0", Peers: NewStaticDirectory()}
		tt.mod(&c)
		if _, err := c.withDefaults(); err == nil || !strings.HasPrefix(err.Error(), tt.field+":") {
			t.Errorf("negative %s: %v, want an error naming it", tt.field, err)
		}
	}
}
