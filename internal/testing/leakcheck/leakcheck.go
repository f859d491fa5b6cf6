// Package leakcheck is the tests' goroutine-leak check: goleak, with a wait
// that fits a loaded machine.
//
// goleak.Find retries for about half a second. Some goroutines end later
// than that after their owner stopped, through no leak: memberlist's
// Shutdown does not join the handler of a TCP stream it accepted, which
// ends at the stream's read deadline (TCPTimeout, a second or more), and on
// a machine with a load average of 15 any goroutine may wait that long to
// be scheduled. Find keeps looking until no goroutine is left or Timeout
// passed, so a real leak still fails, only later.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Timeout bounds the wait for goroutines to end.
const Timeout = 30 * time.Second

// Find returns goleak's report of the goroutines still running after
// Timeout, or nil as soon as none is.
func Find(opts ...goleak.Option) error {
	deadline := time.Now().Add(Timeout)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Check runs after m.Run: when the tests passed (code 0), a goroutine still
// running after Timeout fails the run. It returns the exit code.
func Check(code int, opts ...goleak.Option) int {
	if code != 0 {
		return code
	}
	if err := Find(opts...); err != nil {
		fmt.Fprintln(os.Stderr, "goleak:", err)
		return 1
	}
	return 0
}

// VerifyTestMain runs m's tests, then cleanup (may be nil), then the check,
// and exits.
func VerifyTestMain(m *testing.M, cleanup func(), opts ...goleak.Option) {
	code := m.Run()
	if cleanup != nil {
		cleanup()
	}
	os.Exit(Check(code, opts...))
}
