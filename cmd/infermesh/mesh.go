package main

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
)

// Mesh membership commands.

func init() {
	register(newJoinCmd)
}

func newJoinCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "join ADDR...",
		Short: "Contact gossip addresses (host:port) now; the agent keeps rejoining them",
		Long: `join contacts the given gossip addresses at once. The agent needs no help to
stay in the mesh: it rejoins its configured mesh.join addresses and the peers it
saw last (kept in its state store) whenever they are not live members. Addresses
given here are added to those it rejoins, until the agent restarts.`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return call(a, cmd, func(c *admin.Client, ctx context.Context) (admin.JoinResult, error) {
				return c.Join(ctx, args)
			}, func(r admin.JoinResult) string {
				return fmt.Sprintf("contacted %d of %d; members: %s\n", r.Contacted, len(args), strings.Join(r.Members, ", "))
			})
		},
	}
}

func init() {
	register(newCertCmd)
}

func newCertCmd(a *app) *cobra.Command {
	var authority string
	cmd := &cobra.Command{
		Use:   "cert CERTIFICATE|FILE",
		Short: "Show an admission certificate: subject, key, scope, issue and expiry (offline)",
		Long: `cert prints what an admission certificate says: the node it is issued to,
its public key, its scope, when it was issued and when it expires (and whether
it has). With --authority KEY it also checks the signature, and exits 1
when that authority did not sign it. The argument is the certificate itself
or a file holding it (trust.certificate's forms).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			text := strings.TrimSpace(args[0])
			c, err := identity.ParseCertificate(text)
			if err != nil {
				b, ferr := os.ReadFile(args[0])
				if ferr != nil {
					return fmt.Errorf("neither a certificate (%v) nor a readable file (%v)", err, ferr)
				}
				if c, err = identity.ParseCertificate(strings.TrimSpace(string(b))); err != nil {
					return fmt.Errorf("%s: %w", args[0], err)
				}
			}
			now := time.Now()
			out := certInfo{Name: c.Name, PublicKey: identity.EncodeNodeKey(c.PublicKey), Scope: c.Scope.String(),
				IssuedAt: c.IssuedAt.UTC(), Expires: c.Expires.UTC(), Expired: !now.Before(c.Expires)}
			if authority != "" {
				k, err := identity.ParseAuthorityKey(authority)
				if err != nil {
					return fmt.Errorf("--authority: %w", err)
				}
				ok := identity.VerifyCertificate(c, []ed25519.PublicKey{k}) == nil
				out.SignatureOK = &ok
			}
			left := "expired " + now.Sub(c.Expires).Round(time.Minute).String() + " ago"
			if !out.Expired {
				left = "expires in " + c.Expires.Sub(now).Round(time.Minute).String()
			}
			text = fmt.Sprintf("subject:    %s\npublic key: %s\nscope:      %s\nissued:     %s\nexpires:    %s (%s)\n",
				out.Name, out.PublicKey, out.Scope, out.IssuedAt.Format(time.RFC3339), out.Expires.Format(time.RFC3339), left)
			if out.SignatureOK != nil {
				text += fmt.Sprintf("signature:  %s\n", map[bool]string{true: "valid for the authority", false: "NOT by this authority"}[*out.SignatureOK])
			}
			if err := a.print(out, strings.TrimSuffix(text, "\n")); err != nil {
				return err
			}
			if out.SignatureOK != nil && !*out.SignatureOK {
				// What it says is printed; that it is not this
				// authority's is the answer a script acts on: exit 1.
				return fmt.Errorf("the certificate of %s is not signed by authority %s", out.Name, authority)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&authority, "authority", "", "check the signature against this authority public `KEY` (base64)")
	return cmd
}

type certInfo struct {
	Name        string    `json:"name"`
	PublicKey   string    `json:"public_key"`
	Scope       string    `json:"scope"`
	IssuedAt    time.Time `json:"issued_at"`
	Expires     time.Time `json:"expires"`
	Expired     bool      `json:"expired"`
	SignatureOK *bool     `json:"signature_ok,omitempty"`
}
