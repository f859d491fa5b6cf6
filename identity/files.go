package identity

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// writeFileExclusive writes data to path with mode 0600 atomically: the
// content is written and synced to a temporary file that is then linked into
// place, so readers never see a partial file and an existing file is never
// replaced (the error wraps fs.ErrExist).
func writeFileExclusive(path string, data []byte) error {
	tmp, err := writeTemp(path, data)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	if err := os.Link(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

// writeFileAtomic writes data to path with mode 0600, replacing any existing
// file atomically (temporary file, sync, rename).
func writeFileAtomic(path string, data []byte) error {
	tmp, err := writeTemp(path, data)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

func writeTemp(path string, data []byte) (string, error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	name := f.Name()
	fail := func(err error) (string, error) {
		f.Close()
		os.Remove(name)
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	// CreateTemp already uses 0600; Chmod guards against a permissive umask
	// configuration on exotic filesystems.
	if err := f.Chmod(0o600); err != nil {
		return fail(err)
	}
	if err := chownToDirOwner(f, filepath.Dir(path)); err != nil {
		return fail(err)
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		os.Remove(name)
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	return name, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// chownToDirOwner gives a file root writes into another user's directory to
// that user: `sudo infermeshd -keygen` on a host where the agent runs as
// its own user (the unit's StateDirectory is the user's) makes a key the
// agent can read. Other callers, and root's own directories, keep the
// file as it is.
func chownToDirOwner(f *os.File, dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	st, err := os.Stat(dir)
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || sys.Uid == 0 {
		return nil
	}
	return f.Chown(int(sys.Uid), int(sys.Gid))
}

// WriteSecretFile writes a secret (a token, a key) to path with mode 0600,
// owned like its directory, replacing any existing file atomically.
func WriteSecretFile(path string, data []byte) error { return writeFileAtomic(path, data) }
