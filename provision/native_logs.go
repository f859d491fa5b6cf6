package provision

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

// A native instance's stdout and stderr go to files in its node folder
// (logs/<ref>.stdout.log, logs/<ref>.stderr.log), opened for append by the
// process itself: a pipe would die with the agent, a file outlives it. The
// agent follows the files from where the current run began, and after an
// adoption from the last LogTail lines, turning lines into observations.
// It keeps each file under MaxLogBytes by copying it to <file>.1 and
// truncating it (the process writes with O_APPEND, so it carries on at the
// new end); while the agent is down the files grow unchecked.

// logPaths are the stdout and stderr files of ref in the node folder dir.
func logPaths(dir, ref string) (stdout, stderr string) {
	base := filepath.Join(dir, "logs", ref)
	return base + ".stdout.log", base + ".stderr.log"
}

// removeLogs deletes ref's log files and their rotated copies.
func removeLogs(dir, ref string) error {
	out, errp := logPaths(dir, ref)
	var errs []error
	for _, p := range []string{out, errp, out + ".1", errp + ".1"} {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// openLog opens path for the process to append to.
func openLog(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	return os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
}

// fileSize is path's size, 0 when it does not exist.
func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// tailOffset is where the last n lines of path begin (its size when n < 1).
func tailOffset(path string, n int) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0
	}
	size := fi.Size()
	if n < 1 {
		return size
	}
	const block = 32 << 10
	buf := make([]byte, block)
	end := size
	// A last line without its newline yet counts as a line.
	seen := -1
	if size > 0 {
		var last [1]byte
		if _, err := f.ReadAt(last[:], size-1); err == nil && last[0] != '\n' {
			seen = 0
		}
	}
	for end > 0 {
		start := max(end-block, 0)
		chunk := buf[:end-start]
		if _, err := f.ReadAt(chunk, start); err != nil && !errors.Is(err, io.EOF) {
			return 0
		}
		for i := len(chunk) - 1; i >= 0; i-- {
			if chunk[i] != '\n' {
				continue
			}
			seen++
			if seen == n {
				return start + int64(i) + 1
			}
		}
		end = start
	}
	return 0
}

// tailer follows one log file and emits its lines.
type tailer struct {
	path     string
	offset   int64
	maxBytes int64
	poll     time.Duration
	emit     func(string)
}

// run follows the file until ctx is done, or until final is closed and
// everything written so far has been read.
func (t *tailer) run(ctx context.Context, final <-chan struct{}) {
	w := &lineWriter{emit: t.emit}
	defer w.flush()
	buf := make([]byte, 32<<10)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		draining := false
		select {
		case <-final:
			draining = true
		default:
		}
		t.readAvailable(w, buf)
		if draining || ctx.Err() != nil {
			return
		}
		timer.Reset(t.poll)
		select {
		case <-ctx.Done():
			return
		case <-final:
		case <-timer.C:
		}
	}
}

// readAvailable reads from offset to the end of the file, restarting from
// the beginning when the file was truncated, and rotates it when it grew
// past maxBytes.
func (t *tailer) readAvailable(w *lineWriter, buf []byte) {
	f, err := os.Open(t.path)
	if err != nil {
		return
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() < t.offset {
		t.offset = 0 // truncated by someone
	}
	for {
		n, err := f.ReadAt(buf, t.offset)
		if n > 0 {
			w.Write(buf[:n])
			t.offset += int64(n)
		}
		if err != nil || n == 0 {
			break
		}
	}
	if t.maxBytes > 0 && t.offset > t.maxBytes {
		t.rotate(f)
	}
}

// rotate copies the file to <path>.1 and truncates it.
func (t *tailer) rotate(f *os.File) {
	tmp := t.path + ".1.tmp"
	dst, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return
	}
	_, err = io.Copy(dst, io.NewSectionReader(f, 0, t.offset))
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, t.path+".1")
	}
	if err != nil {
		os.Remove(tmp)
		return
	}
	if err := os.Truncate(t.path, 0); err == nil {
		t.offset = 0
	}
}
