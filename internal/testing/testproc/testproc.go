// Package testproc holds what tests that run real servers and processes
// wait on and look at: a server's health answer, a process being alive,
// and a poll-until with a deadline (tests wait for conditions, never for
// fixed times). Free ports are internal/testnet's.
package testproc

import (
	"bytes"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"
)

var client = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// Healthy reports whether GET http://127.0.0.1:<port>/health answers 200.
func Healthy(port int) bool {
	resp, err := client.Get("http://127.0.0.1:" + strconv.Itoa(port) + "/health")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Alive reports whether pid is a live process: it exists and is not a
// zombie (exited, waiting to be reaped).
func Alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && i+2 < len(b) && b[i+2] != 'Z'
}

// WaitUntil polls cond every 10ms until it holds, failing the test when it
// does not within d: the one poll of the tests (each package's waitFor or
// eventually only fixes its bound). d is a bound for a loaded machine,
// never a speed the test asserts.
func WaitUntil(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// OpenFDs counts pid's open file descriptors.
func OpenFDs(t testing.TB, pid int) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// MemKB reads a memory field of /proc/<pid>/status in KiB: VmRSS (the
// resident set now), VmHWM (its peak), ...
func MemKB(t testing.TB, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte(field+":")); ok {
			f := bytes.Fields(v)
			if len(f) == 2 && string(f[1]) == "kB" {
				if n, err := strconv.ParseInt(string(f[0]), 10, 64); err == nil {
					return n
				}
			}
			break
		}
	}
	t.Fatalf("/proc/%d/status has no %s in kB", pid, field)
	return 0
}
