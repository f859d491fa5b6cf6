package main

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/infermesh/infermesh/agent/admin"
	"github.com/infermesh/infermesh/cleanup"
)

// refusedError is a socket the kernel refused this user, with what the
// agent's config says of admin.group when this user may read it (it is
// root's, group infermesh, mode 0640: often it may not).
type refusedError struct {
	*admin.SocketRefusedError
	hint string
}

func (e *refusedError) Error() string { return e.SocketRefusedError.Error() + e.hint }

func (e *refusedError) Unwrap() error { return e.SocketRefusedError }

// explainRefusal adds admin.group from the config at configPath to a
// refused socket, when the config is readable and names that socket.
func explainRefusal(err error, configPath string) error {
	var re *admin.SocketRefusedError
	if !errors.As(err, &re) {
		return err
	}
	cfg, cerr := cleanup.ReadSiteConfig(configPath)
	if cerr != nil || filepath.Clean(cfg.AdminSocket) != filepath.Clean(re.Path) {
		return err
	}
	var hint string
	switch g := cfg.AdminGroup; {
	case g == "":
		hint = fmt.Sprintf("; %s sets no admin.group, so members of %s may only read: changes need root or the agent's user", configPath, re.Group)
	case g == re.Group || g == fmt.Sprint(re.GID):
		hint = fmt.Sprintf("; it is admin.group in %s: its members may change things", configPath)
	default:
		hint = fmt.Sprintf("; %s names admin.group %s (the agent gives it the socket when it starts)", configPath, g)
	}
	return &refusedError{SocketRefusedError: re, hint: hint}
}
