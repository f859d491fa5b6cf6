package mesh

import (
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"
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
