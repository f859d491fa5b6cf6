package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"time"
)

// Install is what a session puts on a host and starts, in this order:
// the account, directories, uploads, files, the node key (made on the
// host), the admission certificate, then units enabled and started.
// Everything is recorded (SessionSpec.OnInstalled) before it is created,
// so removal undoes exactly what was put there, even after a crash (the
// account's sysusers.d file included; the user itself stays, as system
// users do: files may still carry its id).
type Install struct {
	// Account, when set, is the system user the agent runs as.
	Account *Account
	// Dirs are created (and owned: removed with their contents).
	Dirs []Dir
	// StagingDir is where uploads land before they are installed; one of
	// Dirs.
	StagingDir string
	// Uploads are local files copied to the host and checked by sha256
	// there.
	Uploads []Upload
	// Files are written with their mode (config, keyring, unit files).
	Files []File
	// Keygen makes the node key on the host, so the private key never
	// travels, and prints its public key (base64) as its last line.
	Keygen string
	// Issue returns the admission certificate file for the public key
	// Keygen printed.
	Issue func(ctx context.Context, pub string) (File, error)
	// Units are enabled and started (systemctl enable --now), in order,
	// and must then be active.
	Units []string
	// UploadTimeout bounds each upload. Default 10m.
	UploadTimeout time.Duration
}

// Account is a system user declared by a sysusers.d file.
type Account struct {
	// Sysusers is the sysusers.d file (configs/infermesh.sysusers),
	// written first and applied with systemd-sysusers, which creates the
	// user and group when missing and leaves existing ones alone.
	Sysusers File
	// User is the user it declares.
	User string
	// JoinIfPresent are groups the user joins where the host has them
	// (docker: the socket's group). A host without the group gets a line
	// in the log saying so, and the install goes on.
	JoinIfPresent []string
}

// Dir is a directory to create.
type Dir struct {
	Path string
	Mode fs.FileMode
}

// Upload is a local file to copy to Path.
type Upload struct {
	Path  string
	Mode  fs.FileMode
	Local string
	// SHA256 is the hex digest the file must have on the host.
	SHA256 string
}

// File is content to write to Path.
type File struct {
	Path string
	Mode fs.FileMode
	Data []byte
	// Group owns the file when set (the account's group: a config the
	// agent reads as its own user). Owner stays root.
	Group string
}

// TopLevel returns every path the install creates that is not inside a
// directory it creates: the paths that must not exist beforehand.
func (in Install) TopLevel() []string {
	var out []string
	under := func(p string) bool {
		for _, d := range in.Dirs {
			if p != d.Path && strings.HasPrefix(p, strings.TrimSuffix(d.Path, "/")+"/") {
				return true
			}
		}
		return false
	}
	add := func(p string) {
		if !under(p) && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	if in.Account != nil {
		add(in.Account.Sysusers.Path)
	}
	for _, d := range in.Dirs {
		add(d.Path)
	}
	for _, u := range in.Uploads {
		add(u.Path)
	}
	for _, f := range in.Files {
		add(f.Path)
	}
	return out
}

// FreshChecks are boot checks that none of the install's top-level paths
// exists: the bootstrap never overwrites (and so never later removes)
// something it did not put there.
func (in Install) FreshChecks() []Check {
	var out []Check
	for _, p := range in.TopLevel() {
		out = append(out, Check{
			Name:    "absent " + p,
			Command: "test ! -e " + shellQuote(p) + " && test ! -L " + shellQuote(p),
			Hint:    p + " exists: infermesh is installed there already, or was left over; remove it first",
		})
	}
	return out
}

// checkPath refuses paths removal could not safely undo.
func checkPath(p string) error {
	if !path.IsAbs(p) || path.Clean(p) != p || p == "/" || strings.ContainsAny(p, "\x00\n") {
		return fmt.Errorf("install path %q: want a clean absolute path below /", p)
	}
	return nil
}

func (s *Session) recordInstalled(kind, p string) error {
	if kind != InstalledUnit {
		if err := checkPath(p); err != nil {
			return err
		}
	}
	if s.spec.OnInstalled == nil {
		return nil
	}
	if err := s.spec.OnInstalled(Installed{Kind: kind, Path: p}); err != nil {
		return fmt.Errorf("record %s before creating it: %w", p, err)
	}
	return nil
}

// install runs the Install (stage agent_starting).
func (s *Session) install(ctx context.Context) error {
	in := s.spec.Install
	if in.Account != nil {
		if err := s.account(ctx, *in.Account); err != nil {
			return err
		}
	}
	for _, d := range in.Dirs {
		if err := s.recordInstalled(InstalledDir, d.Path); err != nil {
			return err
		}
		if err := s.exec(ctx, fmt.Sprintf("install -d -m %04o %s", d.Mode.Perm(), shellQuote(d.Path)), nil, nil); err != nil {
			return fmt.Errorf("create %s: %w", d.Path, err)
		}
	}
	for _, u := range in.Uploads {
		if err := s.upload(ctx, u); err != nil {
			return err
		}
	}
	for _, f := range in.Files {
		if err := s.writeFile(ctx, f); err != nil {
			return err
		}
	}
	if in.Keygen != "" {
		var out []string
		if err := s.exec(ctx, in.Keygen, nil, func(l string) { out = append(out, l) }); err != nil {
			return fmt.Errorf("node key: %w", err)
		}
		if len(out) == 0 {
			return errors.New("node key: keygen printed nothing")
		}
		pub := strings.TrimSpace(out[len(out)-1])
		if s.spec.OnNodeKey != nil {
			if err := s.spec.OnNodeKey(pub); err != nil {
				return fmt.Errorf("node key: %w", err)
			}
		}
		if in.Issue != nil {
			cert, err := in.Issue(ctx, pub)
			if err != nil {
				return fmt.Errorf("admission certificate: %w", err)
			}
			if err := s.writeFile(ctx, cert); err != nil {
				return err
			}
		}
	}
	if len(in.Units) == 0 {
		return nil
	}
	if err := s.exec(ctx, "systemctl daemon-reload", nil, nil); err != nil {
		return fmt.Errorf("systemctl daemon-reload: %w", err)
	}
	for _, u := range in.Units {
		if err := s.recordInstalled(InstalledUnit, u); err != nil {
			return err
		}
		startErr := s.exec(ctx, "systemctl enable --now "+shellQuote(u), nil, nil)
		var state []string
		_ = s.exec(ctx, "systemctl is-active "+shellQuote(u)+" || true", nil, func(l string) { state = append(state, l) })
		if active := len(state) > 0 && strings.TrimSpace(state[0]) == "active"; startErr != nil || !active {
			// The unit's own words say why: into the log as stderr.
			errOut := s.emitter(Stderr)
			_, _ = s.client.Run(ctx, RemoteCommand{
				Line:   s.asRoot("journalctl -u " + shellQuote(u) + " -n 30 --no-pager -o cat"),
				Stdout: errOut, Stderr: errOut,
			})
			if startErr != nil {
				return fmt.Errorf("systemctl enable --now %s: %w", u, startErr)
			}
			return fmt.Errorf("%s is %s after start, not active", u, strings.Join(state, " "))
		}
	}
	return nil
}

func (s *Session) upload(ctx context.Context, u Upload) error {
	in := s.spec.Install
	if in.StagingDir == "" {
		return errors.New("upload: no staging directory")
	}
	if err := s.recordInstalled(InstalledFile, u.Path); err != nil {
		return err
	}
	f, err := os.Open(u.Local)
	if err != nil {
		return fmt.Errorf("upload %s: %w", u.Path, err)
	}
	defer f.Close()
	staged := path.Join(in.StagingDir, ".upload-"+path.Base(u.Path))
	timeout := in.UploadTimeout
	if timeout <= 0 {
		timeout = 10 * time.Minute
	}
	code, err := s.client.Run(ctx, RemoteCommand{
		Line:    s.asRoot("umask 077 && cat > " + shellQuote(staged)),
		Stdin:   f,
		Stderr:  s.emitter(Stderr),
		Timeout: timeout,
	})
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d", code)
	}
	if err != nil {
		return fmt.Errorf("upload %s: %w", u.Path, err)
	}
	place := fmt.Sprintf("install -m %04o %s %s && rm -f %s", u.Mode.Perm(), shellQuote(staged), shellQuote(u.Path), shellQuote(staged))
	if err := s.exec(ctx, place, nil, nil); err != nil {
		return fmt.Errorf("install %s: %w", u.Path, err)
	}
	var sum []string
	if err := s.exec(ctx, "sha256sum "+shellQuote(u.Path), nil, func(l string) { sum = append(sum, l) }); err != nil {
		return fmt.Errorf("sha256 of %s: %w", u.Path, err)
	}
	if len(sum) == 0 || len(strings.Fields(sum[0])) == 0 || strings.Fields(sum[0])[0] != u.SHA256 {
		return fmt.Errorf("%s: sha256 on the host is %q, want %s", u.Path, strings.Join(sum, " "), u.SHA256)
	}
	return nil
}

// account creates the system user (systemd-sysusers with its file) and
// adds it to those of its groups the host has.
func (s *Session) account(ctx context.Context, a Account) error {
	dir := path.Dir(a.Sysusers.Path)
	var out []string
	if err := s.exec(ctx, "test -d "+shellQuote(dir)+" && echo present || echo absent", nil, func(l string) { out = append(out, l) }); err != nil {
		return fmt.Errorf("look for %s: %w", dir, err)
	}
	if len(out) == 0 || out[len(out)-1] != "present" {
		if err := s.recordInstalled(InstalledParent, dir); err != nil {
			return err
		}
		if err := s.exec(ctx, "install -d -m 0755 "+shellQuote(dir), nil, nil); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
	}
	if err := s.writeFile(ctx, a.Sysusers); err != nil {
		return err
	}
	if err := s.exec(ctx, "systemd-sysusers "+shellQuote(a.Sysusers.Path), nil, nil); err != nil {
		return fmt.Errorf("create user %s: %w", a.User, err)
	}
	for _, g := range a.JoinIfPresent {
		u, q := shellQuote(a.User), shellQuote(g)
		line := "if getent group " + q + " >/dev/null; then usermod -aG " + q + " " + u + " && echo " + shellQuote(a.User+" joined group "+g) +
			"; else echo " + shellQuote("no group "+g+" on this host: once it exists, usermod -aG "+g+" "+a.User+" and restart the agent") + "; fi"
		if err := s.exec(ctx, line, nil, nil); err != nil {
			return fmt.Errorf("add user %s to group %s: %w", a.User, g, err)
		}
	}
	return nil
}

func (s *Session) writeFile(ctx context.Context, f File) error {
	if err := s.recordInstalled(InstalledFile, f.Path); err != nil {
		return err
	}
	line := fmt.Sprintf("umask 077 && cat > %s && chmod %04o %s", shellQuote(f.Path), f.Mode.Perm(), shellQuote(f.Path))
	if f.Group != "" {
		line += " && chgrp " + shellQuote(f.Group) + " " + shellQuote(f.Path)
	}
	if err := s.exec(ctx, line, bytes.NewReader(f.Data), nil); err != nil {
		return fmt.Errorf("write %s: %w", f.Path, err)
	}
	return nil
}

// Uninstall undoes what a bootstrap recorded it installed on the host
// client is connected to as user, newest first: units are disabled and
// stopped, files removed, directories removed with their contents. It
// touches nothing else. Output lines go to emit (nil: dropped).
func Uninstall(ctx context.Context, client Client, user string, items []Installed, emit func(Stream, string)) error {
	var errs []error
	run := func(line string) {
		var out, errOut func(string)
		if emit != nil {
			out = func(l string) { emit(Stdout, l) }
			errOut = func(l string) { emit(Stderr, l) }
		}
		code, err := client.Run(ctx, RemoteCommand{Line: asRoot(user, line), Stdout: out, Stderr: errOut})
		if err == nil && code != 0 {
			err = fmt.Errorf("exit %d", code)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", line, err))
		}
	}
	units := false
	for _, it := range slices.Backward(items) {
		switch it.Kind {
		case InstalledUnit:
			units = true
			// A unit that never loaded has nothing to disable.
			u := shellQuote(it.Path)
			run("if systemctl cat " + u + " >/dev/null 2>&1; then systemctl disable --now " + u + "; fi; systemctl reset-failed " + u + " 2>/dev/null || true")
		case InstalledFile:
			if err := checkPath(it.Path); err != nil {
				errs = append(errs, err)
				continue
			}
			run("rm -f " + shellQuote(it.Path))
		case InstalledDir:
			if err := checkPath(it.Path); err != nil {
				errs = append(errs, err)
				continue
			}
			run("rm -rf --one-file-system " + shellQuote(it.Path))
		case InstalledParent:
			if err := checkPath(it.Path); err != nil {
				errs = append(errs, err)
				continue
			}
			run("rmdir --ignore-fail-on-non-empty " + shellQuote(it.Path))
		default:
			errs = append(errs, fmt.Errorf("unknown installed kind %q (%s)", it.Kind, it.Path))
		}
	}
	if units {
		run("systemctl daemon-reload")
	}
	return errors.Join(errs...)
}
