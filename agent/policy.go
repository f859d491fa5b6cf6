package agent

import (
	"crypto/ed25519"
	"time"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/identity"
	"github.com/infermesh/infermesh/store"
)

// fact is one effective policy fact and where it came from.
type fact struct {
	on     bool
	source string
	by     string
	at     time.Time
}

// effectivePolicy is the config with the overrides on top.
type effectivePolicy struct {
	expose   map[string]fact            // role ->
	serve    map[string]map[string]fact // role -> peer -> (on or off)
	accept   map[string]map[string]fact // role -> node -> (on or off)
	revoked  map[string]fact            // run-time revocations
	signed   map[string]fact            // signed statements held (on: revoked), by subject
	active   int                        // overrides in force
	inactive map[store.Key]bool         // overrides naming a role the config lacks
}

// computePolicy is the effective role policy: the config's roles as the
// baseline (expose, serve_to and accept_from; a role not exposed says so as
// the default), with the stored run-time overrides on top, each one
// replacing the config's fact it names, on or off. Revocations apply
// whatever the config's roles. An override naming a role the config does
// not have is kept but inactive (it applies again if the role comes back);
// so is a signed revocation that trust.authority did not sign. It does no
// I/O: applyLocked makes the table and the mesh match it.
func computePolicy(cfg *Config, ovs []store.Override) effectivePolicy {
	p := effectivePolicy{
		expose: map[string]fact{}, serve: map[string]map[string]fact{}, accept: map[string]map[string]fact{},
		revoked: map[string]fact{}, signed: map[string]fact{}, inactive: map[store.Key]bool{},
	}
	var authorities []ed25519.PublicKey
	if k, err := identity.ParseAuthorityKey(cfg.Trust.Authority); err == nil {
		authorities = append(authorities, k)
	}
	set := func(m map[string]map[string]fact, role, node string, f fact) {
		if m[role] == nil {
			m[role] = map[string]fact{}
		}
		m[role][node] = f
	}
	for name, r := range cfg.Roles {
		if r.Expose {
			p.expose[name] = fact{on: true, source: admin.SourceConfig}
		} else {
			p.expose[name] = fact{on: false, source: admin.SourceDefault}
		}
		p.serve[name] = map[string]fact{}
		p.accept[name] = map[string]fact{}
		for _, n := range r.ServeTo {
			set(p.serve, name, n, fact{on: true, source: admin.SourceConfig})
		}
		for _, n := range r.AcceptFrom {
			set(p.accept, name, n, fact{on: true, source: admin.SourceConfig})
		}
	}
	for _, o := range ovs {
		f := fact{on: o.On, source: admin.SourceRuntime, by: o.By, at: o.At}
		switch o.Kind {
		case store.KindRevoke:
			p.revoked[o.Node] = f
			p.active++
			continue
		case store.KindSignedRevoke:
			f.source = admin.SourceAuthority
			r, err := identity.ParseRevocation(o.Statement)
			if err == nil {
				_, err = identity.VerifyRevocation(r, authorities)
			}
			if err != nil {
				p.inactive[o.Key()] = true
				continue
			}
			p.signed[o.Node] = f
			p.active++
			continue
		}
		if _, ok := cfg.Roles[o.Role]; !ok {
			p.inactive[o.Key()] = true
			continue
		}
		p.active++
		switch o.Kind {
		case store.KindExpose:
			p.expose[o.Role] = f
		case store.KindServeTo:
			set(p.serve, o.Role, o.Node, f)
		case store.KindAcceptFrom:
			set(p.accept, o.Role, o.Node, f)
		}
	}
	return p
}

// lookup is the fact an override key names (the zero fact: off, no source).
func (p effectivePolicy) lookup(k store.Key) fact {
	switch k.Kind {
	case store.KindExpose:
		return p.expose[k.Role]
	case store.KindServeTo:
		return p.serve[k.Role][k.Node]
	case store.KindAcceptFrom:
		return p.accept[k.Role][k.Node]
	case store.KindRevoke:
		return p.revoked[k.Node]
	case store.KindSignedRevoke:
		return p.signed[k.Node]
	}
	return fact{}
}

// onSet is the set of nodes whose fact is on.
func onSet(m map[string]fact) map[string]bool {
	out := map[string]bool{}
	for n, f := range m {
		if f.on {
			out[n] = true
		}
	}
	return out
}
