package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"
)

// clockTick is the unit of utime and stime in /proc/<pid>/stat (USER_HZ,
// 100 on every Linux architecture Go supports).
const clockTick = 10 * time.Millisecond

// procStat is what treeCPU needs from one /proc/<pid>/stat.
type procStat struct {
	ppid int
	cpu  time.Duration // utime + stime, every thread of the process
}

// parseProcStat reads the parent and the user+system CPU from the text of
// /proc/<pid>/stat. The command name (field 2) is in parentheses and may
// hold spaces and parentheses itself, so the fields are counted from the
// last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errors.New("no ')' after the command name")
	}
	// After ')': state(3) ppid(4) pgrp session tty_nr tpgid flags minflt
	// cminflt majflt cmajflt utime(14) stime(15).
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("%d fields after the command name, want at least 13", len(f))
	}
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil {
		return procStat{}, fmt.Errorf("ppid: %w", err)
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(string(s), 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("utime/stime: %w", err)
		}
		ticks += v
	}
	return procStat{ppid: ppid, cpu: time.Duration(ticks) * clockTick}, nil
}

// treeCPU returns the user+system CPU the processes roots and all their
// descendants (nginx's workers under its master) have used so far: each
// process's stat covers all its threads. A process that is gone counts
// nothing; it is an error when no root is there.
func treeCPU(roots []int) (time.Duration, error) {
	if len(roots) == 0 {
		return 0, errors.New("no processes")
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	stats := map[int]procStat{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // exited since the listing
		}
		if st, err := parseProcStat(b); err == nil {
			stats[pid] = st
		}
	}
	return sumTree(stats, roots)
}

// sumTree sums the CPU of roots and their descendants in stats.
func sumTree(stats map[int]procStat, roots []int) (time.Duration, error) {
	in := map[int]bool{}
	found := false
	for _, r := range roots {
		if _, ok := stats[r]; ok {
			in[r], found = true, true
		}
	}
	if !found {
		return 0, fmt.Errorf("none of the processes %v is running", roots)
	}
	// A process is in when an ancestor is: walk up from each one.
	var total time.Duration
	for pid, st := range stats {
		for p, hops := pid, 0; p > 1 && hops < 64; p, hops = stats[p].ppid, hops+1 {
			if in[p] {
				total += st.cpu
				break
			}
			if _, ok := stats[p]; !ok {
				break
			}
		}
	}
	return total, nil
}
