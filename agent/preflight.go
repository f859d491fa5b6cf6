package agent

import (
	"crypto/ed25519"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/mesh"
)

// This file holds what is checked of a config beyond its text, against the
// node's state dir, by the agent before it starts and by infermeshd
// -validate alike, so that -validate exits 0 exactly when the agent would
// start: this node's admission certificate, against trust.authority,
// node.name and the node key, and, with a mesh, the gossip keyring. It
// does not bind the ports or open the state store (a running agent holds
// both). It also lists what a config the agent starts
// with almost certainly does not mean (warnings): a role nothing can serve,
// a policy name nothing can admit, a certificate that has expired or soon
// will.

// Preflight checks c, once validated, against its node's state dir at now,
// reading only (nothing is created). err is the first problem that stops
// the agent from starting, naming the field (a *FieldError); warnings are
// what the agent would start with and warn about, each naming the field
// and saying what to change. The run-time policy overrides of the state
// store are not read: a role they let a peer serve is still reported.
func (c *Config) Preflight(now time.Time) (warnings []string, err error) {
	cert, warnings, err := c.checkCertificate()
	if err != nil {
		return nil, err
	}
	if c.Mesh.Enabled() {
		notes, err := c.checkKeyring()
		if err != nil {
			return nil, err
		}
		warnings = append(warnings, notes...)
	}
	if cert != nil {
		exp := cert.Expires.UTC().Format(time.RFC3339)
		switch left := cert.Expires.Sub(now); {
		case left <= 0:
			warnings = append(warnings, fmt.Sprintf("trust.certificate: expired at %s: every peer refuses this node, so it serves only its local roles and does not join; issue a new one (infermesh authority issue)", exp))
		case left < mesh.CertWarnBefore:
			warnings = append(warnings, fmt.Sprintf("trust.certificate: expires at %s, in %s; issue a new one (infermesh authority issue) before then", exp, left.Round(time.Minute)))
		}
	}
	if c.Mesh.Enabled() {
		warnings = append(warnings, c.UnknownPolicyNodes()...)
	}
	warnings = append(warnings, c.unservableRoles(computePolicy(c, nil).accept, false)...)
	return warnings, nil
}

// ownCertificate reads and parses this node's admission certificate: the
// value itself, or the file it names (relative to the state dir). It is nil
// without one. A file that cannot be read is a *FieldError wrapping the
// cause.
func (c *Config) ownCertificate() (*identity.Certificate, error) {
	const f = "trust.certificate"
	v := strings.TrimSpace(c.Trust.Certificate)
	if v == "" {
		return nil, nil
	}
	cert, perr := identity.ParseCertificate(v)
	if perr == nil {
		return cert, nil
	}
	p := v
	if !filepath.IsAbs(p) {
		p = filepath.Join(c.Node.StateDir, p)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, &FieldError{Field: f, Msg: fmt.Sprintf("neither an admission certificate (%v) nor a readable file (%v)", perr, err), cause: err}
	}
	if cert, err = identity.ParseCertificate(string(b)); err != nil {
		return nil, fieldErr(f, "the file %s does not hold an admission certificate: %v", p, err)
	}
	return cert, nil
}

// checkCertificate refuses a certificate the agent could not start with,
// or that no peer of this config's trust would admit: one issued to another
// name, signed by another authority than trust.authority, or issued for
// another key than the node key in node.state_dir (where it is readable;
// with a mesh, a node key yet to be made cannot match either). notes are
// the checks it could not make, and why.
func (c *Config) checkCertificate() (cert *identity.Certificate, notes []string, err error) {
	const f = "trust.certificate"
	cert, err = c.ownCertificate()
	if errors.Is(err, fs.ErrPermission) {
		return nil, []string{f + ": not checked: " + err.(*FieldError).Msg + " (run it as the agent's user)"}, nil
	}
	if err != nil || cert == nil {
		return nil, nil, err
	}
	if cert.Name != c.Node.Name {
		return nil, nil, fieldErr(f, "issued to node %q, but node.name is %q: issue one for %q (infermesh authority issue --name %s)",
			cert.Name, c.Node.Name, c.Node.Name, c.Node.Name)
	}
	if a := strings.TrimSpace(c.Trust.Authority); a != "" {
		k, err := identity.ParseAuthorityKey(a)
		if err != nil {
			return nil, nil, fieldErr("trust.authority", "%v", err)
		}
		if identity.VerifyCertificate(cert, []ed25519.PublicKey{k}) != nil {
			return nil, nil, fieldErr(f, "not signed by trust.authority (%s): it was issued by another authority, or altered, and no node that trusts this authority would admit this node; issue one with the authority key of trust.authority", a)
		}
	} else {
		notes = append(notes, f+": not checked against an authority: trust.authority is not set, so only peers whose authority signed it admit this node")
	}
	keyPath := filepath.Join(c.Node.StateDir, identity.NodeKeyFile)
	key, err := identity.LoadKey(keyPath)
	want := identity.EncodeNodeKey(cert.PublicKey)
	switch {
	case err == nil:
		if pub := key.Public().(ed25519.PublicKey); !pub.Equal(cert.PublicKey) {
			return nil, nil, fieldErr(f, "issued for the public key %s, but this node's key (%s) is %s: peers would refuse it; issue one for %s",
				want, keyPath, identity.EncodeNodeKey(pub), identity.EncodeNodeKey(pub))
		}
	case errors.Is(err, fs.ErrNotExist):
		if c.Mesh.Enabled() {
			return nil, nil, fieldErr(f, "issued for the public key %s, but this node has no key yet (%s): the one the agent would make at its start cannot match; make it first (infermeshd --keygen) and issue the certificate for the public key that prints",
				want, keyPath)
		}
	case errors.Is(err, fs.ErrPermission):
		notes = append(notes, fmt.Sprintf("%s: not compared with the node key: %v (run it as the agent's user)", f, err))
	case c.Mesh.Enabled():
		return nil, nil, fieldErr("node.state_dir", "%v", err) // the mesh would refuse to start with it
	}
	return cert, notes, nil
}

// checkKeyring refuses a gossip keyring the mesh could not start with:
// missing, open to other users, or not a keyring. notes are the checks it
// could not make, and why.
func (c *Config) checkKeyring() (notes []string, err error) {
	const f = "mesh.gossip_keyring"
	p := c.Mesh.GossipKeyring
	if !filepath.IsAbs(p) {
		p = filepath.Join(c.Node.StateDir, p)
	}
	_, err = identity.LoadKeyring(p)
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, fs.ErrPermission):
		return []string{fmt.Sprintf("%s: not checked: %v (run it as the agent's user)", f, err)}, nil
	case errors.Is(err, fs.ErrNotExist):
		return nil, &FieldError{Field: f, cause: err, Msg: fmt.Sprintf("%s does not exist: every node of a mesh needs the cluster's gossip keyring; copy it from a member (0600), or make the first node's with infermesh keygen --gossip --keyring %s", p, p)}
	}
	return nil, fieldErr(f, "%v", err)
}

// unservableRoles lists, as warnings, the roles nothing can ever serve:
// no upstream, no instance, and no peer that may serve them to this node
// (accept: role -> node -> fact, the config's accept_from with the
// run-time overrides when overrides says they are in it), or no mesh to
// reach one by. Each says what to add.
func (c *Config) unservableRoles(accept map[string]map[string]fact, overrides bool) []string {
	var out []string
	for _, name := range sortedKeys(c.Roles) {
		r := c.Roles[name]
		if r.Upstream != "" || r.Instance != nil {
			continue
		}
		f := "roles." + name
		local := fmt.Sprintf("add %s.upstream (http://127.0.0.1:<port> of a running server) or %s.instance", f, f)
		allowed := len(onSet(accept[name])) > 0
		switch {
		case !c.Mesh.Enabled() && allowed:
			out = append(out, fmt.Sprintf("%s: nothing can serve it: it has no upstream and no instance, and its accept_from names peers, but no mesh is configured (mesh.bind) to reach them; %s, or configure the mesh", f, local))
		case !c.Mesh.Enabled():
			out = append(out, fmt.Sprintf("%s: nothing can serve it: it has no upstream and no instance, and no mesh is configured (mesh.bind), so no peer can; %s", f, local))
		case !allowed:
			why := "its accept_from names no peer (run-time overrides aside: infermesh policy lists them)"
			if overrides {
				why = "no peer may serve it to this node (accept_from names none, and no run-time override allows one)"
			}
			out = append(out, fmt.Sprintf("%s: nothing can serve it: it has no upstream and no instance, and %s; %s, or name the peers that may serve it in %s.accept_from (or at run time: infermesh allow %s NODE)",
				f, why, local, f, name))
		}
	}
	return out
}
