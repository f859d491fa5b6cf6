package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"go.etcd.io/bbolt"
)

// The clients of this host's proxy (`infermesh clients`), kept like the
// policy: in their own bucket of the store's (bucketClients), changed only
// with the mirror, which holds them too, so a damaged database loses no
// client and brings no removed one back. A record holds the hash of the
// client's key, never the key.

// Client is one client's record.
type Client struct {
	Name string `json:"name"`
	// KeyHash is the hex SHA-256 of its key; "" for a client known by
	// Unix credentials only. KeyHint is what a list shows of the key.
	KeyHash string `json:"key_hash,omitempty"`
	KeyHint string `json:"key_hint,omitempty"`
	// UID (when set) and Unit name the callers on the proxy's Unix
	// socket that are this client.
	UID  *uint32 `json:"uid,omitempty"`
	Unit string  `json:"unit,omitempty"`
	// Roles it may use; empty: every role.
	Roles    []string `json:"roles,omitempty"`
	Priority string   `json:"priority,omitempty"`
	RPM      int64    `json:"rpm,omitempty"`
	TPM      int64    `json:"tpm,omitempty"`
	// MaxConcurrent bounds its requests in flight.
	MaxConcurrent int64 `json:"max_concurrent,omitempty"`
	// Created and Rotated (its key's last change) with who made them.
	Created time.Time `json:"created"`
	Rotated time.Time `json:"rotated,omitzero"`
	By      string    `json:"by,omitempty"`
}

// bucketClients holds the clients (Client JSON under their name), changed
// only with the mirror.
var bucketClients = BucketID{"store", "clients", 1, nil}

var keyHashForm = regexp.MustCompile(`^[0-9a-f]{64}$`)

// validate checks what the store relies on: a name to key the record by
// and a hash, not a key, in KeyHash.
func (c Client) validate() error {
	switch {
	case c.Name == "" || len(c.Name) > 63 || strings.ContainsAny(c.Name, "\x00/ "):
		return fmt.Errorf("client %q: not a client name", c.Name)
	case c.KeyHash != "" && !keyHashForm.MatchString(c.KeyHash):
		return fmt.Errorf("client %q: key_hash is not a hex SHA-256 (the store keeps hashes, never keys)", c.Name)
	}
	return nil
}

// ErrClientExists is returned by AddClient for a name already taken.
var ErrClientExists = errors.New("client exists")

// AddClient records a new client; ErrClientExists when its name is taken.
func (s *Store) AddClient(c Client) error {
	return s.changeClient(c.Name, func(old *Client) (*Client, error) {
		if old != nil {
			return nil, fmt.Errorf("client %q: %w", c.Name, ErrClientExists)
		}
		if c.Created.IsZero() {
			c.Created = time.Now()
		}
		return &c, c.validate()
	})
}

// UpdateClient replaces the record of the client named name with what fn
// makes of it; ok false (and nothing written) when there is none.
func (s *Store) UpdateClient(name string, fn func(*Client)) (c Client, ok bool, err error) {
	err = s.changeClient(name, func(old *Client) (*Client, error) {
		if old == nil {
			return nil, nil
		}
		ok = true
		fn(old)
		old.Name = name
		c = *old
		return old, old.validate()
	})
	return c, ok, err
}

// DeleteClient removes the client named name and returns its record (ok
// false when there was none).
func (s *Store) DeleteClient(name string) (prev Client, ok bool, err error) {
	err = s.changeClient(name, func(old *Client) (*Client, error) {
		if old != nil {
			prev, ok = *old, true
		}
		return nil, nil
	})
	return prev, ok, err
}

// changeClient runs fn on the record of name (nil: none) in one
// transaction: fn's record replaces it (nil with a record there: it is
// deleted), with the mirror.
func (s *Store) changeClient(name string, fn func(old *Client) (*Client, error)) error {
	err := s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketClients.key())
		var old *Client
		if raw := b.Get([]byte(name)); raw != nil {
			old = new(Client)
			if err := json.Unmarshal(raw, old); err != nil {
				return fmt.Errorf("client %q: %w", name, err)
			}
		}
		next, err := fn(old)
		if err != nil {
			return err
		}
		switch {
		case next != nil:
			next.Created, next.Rotated = next.Created.UTC(), next.Rotated.UTC()
			v, err := json.Marshal(next)
			if err != nil {
				return err
			}
			if err := b.Put([]byte(name), v); err != nil {
				return err
			}
		case old != nil:
			if err := b.Delete([]byte(name)); err != nil {
				return err
			}
		default:
			return nil
		}
		return s.commitMirror(tx)
	})
	if err != nil {
		return fmt.Errorf("store client: %w", err)
	}
	return nil
}

// Clients returns every client, by name.
func (s *Store) Clients() ([]Client, error) {
	var out []Client
	err := s.db.View(func(tx *bbolt.Tx) error {
		var err error
		out, err = txClients(tx)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list clients: %w", err)
	}
	return out, nil
}

func txClients(tx *bbolt.Tx) ([]Client, error) {
	var out []Client
	err := tx.Bucket(bucketClients.key()).ForEach(func(k, v []byte) error {
		var c Client
		if err := json.Unmarshal(v, &c); err != nil {
			return fmt.Errorf("client %q: %w", k, err)
		}
		out = append(out, c)
		return nil
	})
	sortClients(out)
	return out, err
}

func sortClients(cs []Client) {
	slices.SortFunc(cs, func(a, b Client) int { return strings.Compare(a.Name, b.Name) })
}

// replaceClients makes the database's clients cs.
func replaceClients(tx *bbolt.Tx, cs []Client) error {
	if err := tx.DeleteBucket(bucketClients.key()); err != nil {
		return err
	}
	b, err := tx.CreateBucket(bucketClients.key())
	if err != nil {
		return err
	}
	for _, c := range cs {
		v, err := json.Marshal(c)
		if err != nil {
			return err
		}
		if err := b.Put([]byte(c.Name), v); err != nil {
			return err
		}
	}
	return nil
}

func sameClients(a, b []Client) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && string(ja) == string(jb)
}
