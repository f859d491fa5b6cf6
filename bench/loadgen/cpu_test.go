package main

import (
	"net"
	"os"
	"strconv"
	"testing"
	"time"
)

func TestParseProcStat(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     procStat
		wantErr  bool
	}{
		{"plain", "42 (nginx) S 7 42 42 0 -1 4194560 100 0 0 0 150 25 0 0 20 0 1 0", procStat{ppid: 7, cpu: 175 * clockTick}, false},
		{"name with spaces and parens", "42 (a b) c)) R 1 42 42 0 -1 0 0 0 0 0 3 4 0 0", procStat{ppid: 1, cpu: 7 * clockTick}, false},
		{"no parens", "42 nginx S 7", procStat{}, true},
		{"short", "42 (x) S 7 1 2", procStat{}, true},
		{"bad number", "42 (x) S 7 42 42 0 -1 0 0 0 0 0 x 4", procStat{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseProcStat([]byte(tc.in))
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("parseProcStat(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestSumTree(t *testing.T) {
	// 10 (master) -> 11, 12 (workers); 12 -> 13; 20 is someone else's; 30 a
	// second root (a two-process path).
	stats := map[int]procStat{
		1: {ppid: 0, cpu: 1000}, 10: {ppid: 1, cpu: 1}, 11: {ppid: 10, cpu: 10}, 12: {ppid: 10, cpu: 100},
		13: {ppid: 12, cpu: 1000}, 20: {ppid: 1, cpu: 10000}, 30: {ppid: 1, cpu: 100000},
	}
	for _, tc := range []struct {
		name  string
		roots []int
		want  time.Duration
	}{
		{"tree", []int{10}, 1111},
		{"leaf", []int{13}, 1000},
		{"two roots", []int{10, 30}, 101111},
		{"one root gone", []int{10, 99}, 1111},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, err := sumTree(stats, tc.roots); err != nil || got != tc.want {
				t.Errorf("sumTree(%v) = %v, %v; want %v", tc.roots, got, err, tc.want)
			}
		})
	}
	if _, err := sumTree(stats, []int{99}); err == nil {
		t.Error("sumTree of a process that is not there: no error")
	}
}

// treeCPU of this process grows as it burns CPU.
func TestTreeCPUSelf(t *testing.T) {
	self := []int{os.Getpid()}
	before, err := treeCPU(self)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		after, err := treeCPU(self)
		if err != nil {
			t.Fatal(err)
		}
		if after > before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("treeCPU stayed at %v for a minute of spinning", before)
		}
		for i := 0; i < 1e6; i++ { // burn some CPU
			_ = i * i
		}
	}
}

// holdPort holds the port for TCP and UDP on both loopback addresses until
// closed.
func TestHoldPort(t *testing.T) {
	held, port, err := holdPort(0)
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.2", strconv.Itoa(port))
	if pc, err := net.ListenPacket("udp", addr); err == nil {
		pc.Close()
		t.Errorf("udp %s bound while held", addr)
	}
	for _, c := range held {
		c.Close()
	}
	again, _, err := holdPort(port)
	if err != nil {
		t.Fatalf("port %d not free after release: %v", port, err)
	}
	for _, c := range again {
		c.Close()
	}
}
