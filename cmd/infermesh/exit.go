package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/infermesh/infermesh/agent/admin"
)

// Exit codes, after sysexits(3), so scripts can tell a typo from an agent
// that is down.
const (
	exitOK          = 0
	exitFailure     = 1  // the command ran and failed (the agent said no, a file exists, cert --authority: another authority signed it, ...)
	exitUsage       = 64 // EX_USAGE: unknown command or flag, wrong arguments
	exitUnavailable = 69 // EX_UNAVAILABLE: no agent answers on the socket
	exitNoPerm      = 77 // EX_NOPERM: the caller was refused: by the agent, or by the socket's mode (not in its group)
)

// usageError is a command line the CLI cannot run.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usageErrorf(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// exitCode maps an error to the process exit code.
func exitCode(err error) int {
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, admin.ErrUnreachable):
		return exitUnavailable
	case errors.Is(err, admin.ErrForbidden):
		return exitNoPerm
	}
	return exitFailure
}

// errorCode is the machine-readable kind of err in --json errors: the
// admin API's code when the agent sent one.
func errorCode(err error) string {
	var ae *admin.APIError
	var ue *usageError
	switch {
	case errors.As(err, &ae) && ae.Code != "":
		return ae.Code
	case errors.As(err, &ue):
		return "usage"
	case errors.Is(err, admin.ErrUnreachable):
		return "unreachable"
	case errors.Is(err, admin.ErrForbidden):
		return "forbidden"
	}
	return "failed"
}

// reportError writes err to w: one line of text, or with --json one JSON
// object {"error": {"code", "message", "exit_code"}}.
func reportError(w io.Writer, asJSON bool, err error, code int) {
	if !asJSON {
		fmt.Fprintln(w, "infermesh:", err)
		return
	}
	type body struct {
		Code     string `json:"code"`
		Message  string `json:"message"`
		ExitCode int    `json:"exit_code"`
	}
	b, _ := json.Marshal(struct {
		Error body `json:"error"`
	}{body{errorCode(err), err.Error(), code}})
	fmt.Fprintln(w, string(b))
}

// markUsageErrors makes cobra's own complaints (a bad flag, the wrong
// number of arguments) usage errors, for cmd and every subcommand.
func markUsageErrors(cmd *cobra.Command) {
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{msg: err.Error()} })
	if args := cmd.Args; args != nil {
		cmd.Args = func(c *cobra.Command, a []string) error {
			if err := args(c, a); err != nil {
				return &usageError{msg: err.Error()}
			}
			return nil
		}
	}
	for _, c := range cmd.Commands() {
		markUsageErrors(c)
	}
}

// isCobraUsage recognises the errors cobra returns without a hook: an
// unknown command, a required flag not set.
func isCobraUsage(err error) bool {
	m := err.Error()
	return strings.HasPrefix(m, "unknown command") || strings.HasPrefix(m, "required flag") ||
		strings.HasPrefix(m, "unknown flag") || strings.HasPrefix(m, "unknown shorthand flag")
}
