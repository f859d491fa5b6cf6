package main

import (
	"github.com/infermesh/infermesh/config"

	"crypto/ed25519"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/identity"
)

func init() {
	register(newKeygenCmd)
	register(newAuthorityCmd)
}

type keyResult struct {
	Path      string `json:"path,omitempty"`
	PublicKey string `json:"public_key,omitempty"`
	GossipKey string `json:"gossip_key,omitempty"`
	// Fingerprint names a gossip key written to a keyring file (the key
	// itself stays in the file), or the authority's public key.
	Fingerprint string `json:"fingerprint,omitempty"`
	Created     bool   `json:"created"`
}

// printKey prints what a key command made: v as JSON with --json, else
// text on stdout (only the key, so $(...) captures it whole) and the
// notice for the operator on stderr.
func (a *app) printKey(v keyResult, text, notice string) error {
	if err := a.print(v, text); err != nil {
		return err
	}
	if notice != "" && !a.json {
		fmt.Fprintln(a.errOut, notice)
	}
	return nil
}

func newKeygenCmd(a *app) *cobra.Command {
	var stateDir, keyFile, keyring string
	var gossip bool
	cmd := &cobra.Command{
		Use:   "keygen",
		Short: "Create this node's key (or print the public key of an existing one), or a gossip key",
		Long: `keygen writes a node key (ed25519, mode 0600) to --key-file or
<state-dir>/node.key and prints its public key. An existing key is never
replaced: its public key is printed.

With --gossip it makes an AES-256 gossip key instead: written as a new
keyring file with --keyring FILE (only its fingerprint is printed), or
printed for a command to capture (NEW=$(infermesh keygen --gossip)); a
secret key is never printed to a terminal.

Only the key goes to stdout; notices go to stderr.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if gossip {
				return gossipKeygen(a, keyring)
			}
			if keyring != "" {
				return errors.New("--keyring needs --gossip")
			}
			path := keyFile
			if path == "" {
				path = filepath.Join(stateDir, identity.NodeKeyFile)
			}
			key, err := identity.LoadKey(path)
			created := false
			if errors.Is(err, fs.ErrNotExist) {
				if err = os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
					return err
				}
				key, err = identity.WriteNewKey(path)
				created = err == nil
			}
			if err != nil {
				return err
			}
			pub := identity.EncodeNodeKey(key.Public().(ed25519.PublicKey))
			notice := ""
			if created {
				notice = fmt.Sprintf("(new key written to %s)", path)
			}
			return a.printKey(keyResult{Path: path, PublicKey: pub, Created: created}, pub, notice)
		},
	}
	cmd.Flags().StringVar(&stateDir, "state-dir", config.DefaultStateDir, "node state directory")
	cmd.Flags().StringVar(&keyFile, "key-file", "", "node key file (default <state-dir>/node.key)")
	cmd.Flags().BoolVar(&gossip, "gossip", false, "make a gossip (AES-256) key instead of a node key")
	cmd.Flags().StringVar(&keyring, "keyring", "", "with --gossip: write a new keyring file holding the key")
	return cmd
}

func gossipKeygen(a *app, keyring string) error {
	if keyring == "" {
		if isTerminal(a.out) {
			return usageErrorf("refusing to print a secret gossip key to a terminal: write a keyring (--keyring FILE) or capture it (NEW=$(infermesh keygen --gossip))")
		}
		k, err := identity.NewGossipKey()
		if err != nil {
			return err
		}
		return a.print(keyResult{GossipKey: k, Created: true}, k)
	}
	k, err := identity.WriteNewKeyring(keyring)
	if err != nil {
		return err
	}
	raw, err := identity.ParseGossipKey(k)
	if err != nil {
		return err
	}
	fp := identity.GossipKeyFingerprint(raw).String()
	return a.printKey(keyResult{Path: keyring, Fingerprint: fp, Created: true}, fp,
		fmt.Sprintf("(new keyring written to %s; the key is its only copy: keep it 0600)", keyring))
}

func newAuthorityCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "authority",
		Short: "Manage the cluster authority key and issue admission certificates (offline)",
	}
	var keyFile string
	cmd.PersistentFlags().StringVar(&keyFile, "key-file", "authority.key", "authority private key file")

	initCmd := &cobra.Command{
		Use:   "init",
		Short: "Create the authority key pair and print its public key (for trust.authority)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			key, err := identity.WriteNewKey(keyFile)
			if err != nil {
				if errors.Is(err, fs.ErrExist) {
					return fmt.Errorf("%s exists; an authority key is never replaced", keyFile)
				}
				return err
			}
			pub := identity.EncodeAuthorityKey(key.Public().(ed25519.PublicKey))
			return a.printKey(keyResult{Path: keyFile, PublicKey: pub, Created: true}, pub,
				fmt.Sprintf("(authority key written to %s; keep it offline)", keyFile))
		},
	}

	showCmd := &cobra.Command{
		Use:   "show",
		Short: "Print the authority's public key (for trust.authority) and its fingerprint, never the private key",
		Long: `show reads the authority key file (--key-file) and prints its public key,
the value of trust.authority, on stdout, and its fingerprint on stderr
(both with --json). The private key is never printed.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			key, err := identity.LoadKey(keyFile)
			if err != nil {
				return fmt.Errorf("authority key: %w", err)
			}
			pub := key.Public().(ed25519.PublicKey)
			fp := identity.PublicKeyFingerprint(pub).String()
			text := identity.EncodeAuthorityKey(pub)
			return a.printKey(keyResult{Path: keyFile, PublicKey: text, Fingerprint: fp}, text,
				fmt.Sprintf("(fingerprint %s; the private key stays in %s)", fp, keyFile))
		},
	}

	var name, pubText, scopeText string
	var ttl time.Duration
	issueCmd := &cobra.Command{
		Use:   "issue",
		Short: "Issue an admission certificate for a node and print it (base64)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			key, err := identity.LoadKey(keyFile)
			if err != nil {
				return fmt.Errorf("authority key: %w", err)
			}
			pub, err := identity.ParseNodeKey(pubText)
			if err != nil {
				return fmt.Errorf("--public-key: %w", err)
			}
			scope, err := identity.ParseScope(scopeText)
			if err != nil {
				return fmt.Errorf("--scope: %w", err)
			}
			cert, err := identity.IssueCertificate(key, name, pub, scope, ttl, time.Now())
			if err != nil {
				return err
			}
			return a.print(struct {
				Certificate string    `json:"certificate"`
				Name        string    `json:"name"`
				PublicKey   string    `json:"public_key"`
				Scope       string    `json:"scope"`
				Expires     time.Time `json:"expires"`
			}{cert.String(), cert.Name, identity.EncodeNodeKey(cert.PublicKey), cert.Scope.String(), cert.Expires.UTC()}, cert.String())
		},
	}
	issueCmd.Flags().StringVar(&name, "name", "", "node name (required)")
	issueCmd.Flags().StringVar(&pubText, "public-key", "", "node `KEY`: its public key, base64 (required; printed by infermesh keygen)")
	issueCmd.Flags().StringVar(&scopeText, "scope", "full", "full (serve and consume) or consumer")
	issueCmd.Flags().DurationVar(&ttl, "ttl", 720*time.Hour, "validity")
	_ = issueCmd.MarkFlagRequired("name")
	_ = issueCmd.MarkFlagRequired("public-key")

	cmd.AddCommand(initCmd, showCmd, issueCmd)
	return cmd
}
