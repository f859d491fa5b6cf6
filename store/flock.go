package store

import (
	"errors"
	"os"
	"syscall"
	"time"
)

// underLock runs check holding f's exclusive lock (bbolt's own, flock),
// waiting up to timeout for another holder: ErrLocked when it does not let
// go. Checking the file under the lock means a file another agent is
// writing is never judged damaged.
func underLock(f *os.File, timeout time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			defer func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN) }()
			return check()
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return err
		}
		if time.Now().After(deadline) {
			return ErrLocked
		}
		time.Sleep(50 * time.Millisecond)
	}
}
