package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strings"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

// newKeyringListCmd lists the gossip keys by fingerprint. The keys
// themselves are asked of the agent only for --out (a file, 0600) or
// --print-keys (stdout, never a terminal).
func newKeyringListCmd(a *app) *cobra.Command {
	var out string
	var printKeys bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the gossip keys by fingerprint and how many nodes hold each",
		Long: `list shows each gossip key by its fingerprint, whether it is the primary
(encrypting) key, and how many live nodes hold it. The keys themselves are
never shown on a terminal: --out FILE writes them to a new keyring file
(mode 0600, the primary first: what mesh.gossip_keyring reads), and
--print-keys prints them, one a line, when stdout is not a terminal.
Both need root, the agent's user or admin.group.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out != "" && printKeys {
				return usageErrorf("--out and --print-keys: choose one")
			}
			if printKeys && isTerminal(a.out) {
				return usageErrorf("refusing to print secret gossip keys to a terminal: write them to a file (--out FILE) or capture them (K=$(infermesh keyring list --print-keys))")
			}
			if out == "" && !printKeys {
				return call(a, cmd, (*admin.Client).Keyring, renderKeyring)
			}
			c := a.client()
			defer c.Close()
			k, err := c.KeyringSecrets(cmd.Context())
			if err != nil {
				return err
			}
			if printKeys {
				return printSecretKeys(a, k)
			}
			return writeKeyring(a, k, out)
		},
	}
	cmd.Flags().StringVar(&out, "out", "", "write the keys themselves to a new keyring `FILE` (0600)")
	cmd.Flags().BoolVar(&printKeys, "print-keys", false, "print the keys themselves, one a line (primary first), when stdout is not a terminal")
	return cmd
}

func keyTexts(k admin.Keyring) ([]string, error) {
	keys := make([]string, 0, len(k.Keys))
	for _, g := range k.Keys {
		if g.Key == "" {
			return nil, fmt.Errorf("the agent sent key %s without the key itself", g.Fingerprint)
		}
		keys = append(keys, g.Key)
	}
	return keys, nil
}

func printSecretKeys(a *app, k admin.Keyring) error {
	keys, err := keyTexts(k)
	if err != nil {
		return err
	}
	if a.json {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		return enc.Encode(k)
	}
	_, err = fmt.Fprintln(a.out, strings.Join(keys, "\n"))
	return err
}

func writeKeyring(a *app, k admin.Keyring, path string) error {
	keys, err := keyTexts(k)
	if err != nil {
		return err
	}
	if err := identity.WriteKeyringFile(path, keys); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%s exists; a keyring file is never replaced", path)
		}
		return err
	}
	k = admin.Keyring{Members: k.Members, Keys: append([]admin.GossipKey(nil), k.Keys...), Note: k.Note}
	for i := range k.Keys {
		k.Keys[i].Key = ""
	}
	if a.json {
		return a.print(struct {
			Path string `json:"path"`
			admin.Keyring
		}{path, k}, "")
	}
	if _, err := fmt.Fprint(a.out, renderKeyring(k)); err != nil {
		return err
	}
	fmt.Fprintf(a.errOut, "(%d key(s) written to %s; keep it 0600)\n", len(keys), path)
	return nil
}
