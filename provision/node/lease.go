package node

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strings"

	"golang.org/x/crypto/ssh"
)

// Lease is the provider boundary (the reference design's provider plugin):
// it acquires the host a node runs on, says where its sshd answers, and
// releases it. Implementations are safe for concurrent use across nodes;
// calls for one node are serialized by its Provisioner. Methods do
// blocking I/O and honour ctx.
type Lease interface {
	// Kind is the provider this lease serves; a spec or handle of another
	// kind is refused.
	Kind() Kind
	// Create acquires the host for spec. The endpoint is nil when it is
	// not known yet (LookupEndpoint follows).
	Create(ctx context.Context, spec Spec) (LeaseFacts, *Endpoint, error)
	// LookupEndpoint finds the lease's SSH endpoint; ok is false when it
	// has none.
	LookupEndpoint(ctx context.Context, lease LeaseFacts) (ep Endpoint, ok bool, err error)
	// Destroy releases the lease. What is already gone is success.
	Destroy(ctx context.Context, h DestroyHandle) error
}

// Fingerprint is the SHA256 fingerprint of a public key, as ssh-keygen -l
// prints it ("SHA256:...").
func Fingerprint(k ssh.PublicKey) string { return ssh.FingerprintSHA256(k) }

// ParseAuthorizedKey parses one public key in authorized_keys format
// ("ssh-ed25519 AAAA... comment").
func ParseAuthorizedKey(s string) (ssh.PublicKey, error) {
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(s))
	if err != nil {
		return nil, fmt.Errorf("public key %.40q: %w", s, err)
	}
	return k, nil
}

// AuthorizedKey is the authorized_keys form of k, without a newline.
func AuthorizedKey(k ssh.PublicKey) string {
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

// NormalizeFingerprint checks a host key fingerprint, as ssh-keygen -lf
// and ssh-keyscan print it (SHA256: and 43 base64 characters; trailing
// '=' padding allowed), and returns it in that form.
func NormalizeFingerprint(fp string) (string, error) {
	fp = strings.TrimSpace(fp)
	const form = "want SHA256: followed by 43 base64 characters, as ssh-keygen -lf prints it (ssh-keyscan HOST | ssh-keygen -lf -)"
	b64, ok := strings.CutPrefix(fp, "SHA256:")
	if !ok {
		return "", fmt.Errorf("host key fingerprint %q: %s", fp, form)
	}
	raw, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(b64, "="))
	if err != nil || len(raw) != sha256.Size {
		return "", fmt.Errorf("host key fingerprint %q is not a SHA256 digest: %s", fp, form)
	}
	return "SHA256:" + base64.RawStdEncoding.EncodeToString(raw), nil
}
