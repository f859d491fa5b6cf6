package provision

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// A native instance's workload record: the ownership evidence of its
// process, written under the site's directory (cleanup.Layout: the node
// folder's workloads/<ref>.json). It is written before the process starts
// (state created, with a fresh token the process will carry in its
// environment), completed once it runs (pid, start time, executable, boot)
// and marked exited when it ends. A record is trusted to name a process
// only when everything in it still holds of that process (see
// WorkloadRecord.Check).

// Workload record states.
const (
	WorkloadCreated = "created" // written; the process may not have started yet
	WorkloadRunning = "running" // started: Pid, StartTime, Executable and BootID are set
	WorkloadExited  = "exited"  // the process ended (or was stopped)
)

// TokenEnv is the environment variable that carries a workload's token in
// its process, so a process the record names can be told from any other
// process that happens to have the same pid, start time and executable.
const TokenEnv = "INFERMESH_WORKLOAD_TOKEN"

// WorkloadRecord is one native workload's record.
type WorkloadRecord struct {
	Version int    `json:"version"`
	Site    string `json:"site"`
	Node    string `json:"node"`
	// Target is the execution target the workload is attributed to: the
	// node.
	Target   string `json:"target"`
	Role     string `json:"role"`
	Ref      string `json:"ref"`
	RunID    uint64 `json:"run_id"`
	Attempt  uint64 `json:"attempt"`
	SpecHash string `json:"spec_hash"`
	// Command is the configured executable; Port where it listens on
	// loopback.
	Command string `json:"command"`
	Port    int    `json:"port"`
	State   string `json:"state"`
	// Token is in the process's environment (TokenEnv); a fresh one per
	// run.
	Token string `json:"token"`
	// Pid, StartTime (/proc/<pid>/stat field 22, clock ticks since boot),
	// Executable (/proc/<pid>/exe) and BootID identify the running
	// process.
	Pid        int    `json:"pid,omitempty"`
	StartTime  uint64 `json:"start_time,omitempty"`
	Executable string `json:"executable,omitempty"`
	BootID     string `json:"boot_id,omitempty"`
	// ExitStatus is the last run's exit status when known.
	ExitStatus *int      `json:"exit_status,omitempty"`
	Created    time.Time `json:"created"`
	Started    time.Time `json:"started,omitzero"`
	Exited     time.Time `json:"exited,omitzero"`
}

const recordVersion = 1

func newToken() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("provision: random token: %v", err)) // crypto/rand does not fail on Linux
	}
	return hex.EncodeToString(b[:])
}

// recordPath is ref's record in the node folder dir.
func recordPath(dir, ref string) string {
	return filepath.Join(dir, "workloads", ref+".json")
}

// readRecord reads the record at path; fs.ErrNotExist when there is none.
func readRecord(path string) (WorkloadRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return WorkloadRecord{}, err
	}
	var r WorkloadRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return WorkloadRecord{}, fmt.Errorf("workload record %s: %w", path, err)
	}
	return r, nil
}

// writeRecord writes r at path atomically and durably: a crash leaves the
// old record or the new one, never a torn one.
func writeRecord(path string, r WorkloadRecord) error {
	r.Version = recordVersion
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("workload record: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".record-*")
	if err != nil {
		return fmt.Errorf("workload record: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("workload record %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("workload record %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("workload record %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("workload record %s: %w", path, err)
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// removeRecord deletes path; already gone is success.
func removeRecord(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("workload record: %w", err)
	}
	return nil
}

// locatedRecord is a record found under a directory, with the node folder it
// was found in.
type locatedRecord struct {
	Path    string
	NodeDir string
	// Folder is the node folder's name: the node the record must name.
	Folder string
	Rec    WorkloadRecord
	Err    error // the record could not be read
}

// findRecords lists the workload records under root, which is either a
// site root (every nodes/<node>/workloads/*.json) or one node folder
// (workloads/*.json; isNode true). Unreadable records are returned with
// Err set, never left out. A missing root has none.
func findRecords(root string, isNode bool) ([]locatedRecord, error) {
	var nodeDirs []string
	if isNode {
		nodeDirs = []string{root}
	} else {
		ents, err := os.ReadDir(filepath.Join(root, "nodes"))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		for _, e := range ents {
			nodeDirs = append(nodeDirs, filepath.Join(root, "nodes", e.Name()))
		}
	}
	var out []locatedRecord
	for _, nd := range nodeDirs {
		ents, err := os.ReadDir(filepath.Join(nd, "workloads"))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			name := e.Name()
			if !strings.HasSuffix(name, ".json") || strings.HasPrefix(name, ".") {
				continue
			}
			p := filepath.Join(nd, "workloads", name)
			rec, err := readRecord(p)
			out = append(out, locatedRecord{Path: p, NodeDir: nd, Folder: filepath.Base(nd), Rec: rec, Err: err})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// Liveness is what the evidence says of a record's process.
type Liveness int

// Liveness values.
const (
	// Gone: the process the record names does not exist (it never started,
	// exited, or belongs to another boot). Nothing is running to stop.
	Gone Liveness = iota
	// Alive: the recorded process runs, and everything recorded about it
	// holds.
	Alive
	// Reused: the pid is alive but is another process (another start
	// time): the recorded one is gone, and the one there must not be
	// touched.
	Reused
	// Forged: the process matches the pid and start time but not the rest
	// of the record (executable, token): the record is not evidence.
	Forged
)

// Evidence is the result of checking a record against the live system.
type Evidence struct {
	Liveness Liveness
	// Pid is the live process the record names (Alive), or the pid checked.
	Pid       int
	StartTime uint64
	// Why says what did not hold (Reused, Forged) or why it is gone.
	Why string
}

// Check tests the record's evidence against the live system: the process
// at Pid must have StartTime, be of this boot, run Executable and carry the
// token in its environment. A created record (the process may have started
// just before the record could be completed) is matched by its token alone,
// among processes that lead their own session and run the recorded
// command. Errors are failures to read the evidence at all (permission).
func (r WorkloadRecord) Check() (Evidence, error) {
	switch r.State {
	case WorkloadExited:
		return Evidence{Liveness: Gone, Why: "exited"}, nil
	case WorkloadCreated:
		if r.Token == "" {
			return Evidence{Liveness: Gone, Why: "never started"}, nil
		}
		pid, err := findByEnv(TokenEnv + "=" + r.Token)
		if err != nil {
			return Evidence{}, err
		}
		if pid == 0 {
			return Evidence{Liveness: Gone, Why: "never started"}, nil
		}
		st, err := readProcStat(pid)
		if err != nil {
			return Evidence{Liveness: Gone, Pid: pid, Why: "exited"}, nil
		}
		exe, err := procExe(pid)
		if err != nil {
			return Evidence{}, fmt.Errorf("pid %d: executable: %w", pid, err)
		}
		if !sameExecutable(exe, r.Command) {
			return Evidence{Liveness: Forged, Pid: pid, StartTime: st.StartTime,
				Why: fmt.Sprintf("pid %d carries the workload's token but runs %s, not %s", pid, exe, r.Command)}, nil
		}
		return Evidence{Liveness: Alive, Pid: pid, StartTime: st.StartTime}, nil
	case WorkloadRunning:
	default:
		return Evidence{}, fmt.Errorf("record state %q is not one of created, running, exited", r.State)
	}
	if r.Pid <= 0 || r.StartTime == 0 || r.Executable == "" || r.BootID == "" || r.Token == "" {
		return Evidence{Liveness: Forged, Pid: r.Pid, Why: "running record without pid, start time, executable, boot or token"}, nil
	}
	boot, err := bootID()
	if err != nil {
		return Evidence{}, err
	}
	if boot != r.BootID {
		return Evidence{Liveness: Gone, Pid: r.Pid, Why: "recorded in an earlier boot"}, nil
	}
	st, err := readProcStat(r.Pid)
	if errors.Is(err, errNoProcess) {
		return Evidence{Liveness: Gone, Pid: r.Pid, Why: "exited"}, nil
	}
	if err != nil {
		return Evidence{}, err
	}
	ev := Evidence{Pid: r.Pid, StartTime: st.StartTime}
	if st.StartTime != r.StartTime {
		ev.Liveness = Reused
		ev.Why = fmt.Sprintf("pid %d is another process now: it started at tick %d, the record says %d", r.Pid, st.StartTime, r.StartTime)
		return ev, nil
	}
	exe, err := procExe(r.Pid)
	if errors.Is(err, errNoProcess) {
		return Evidence{Liveness: Gone, Pid: r.Pid, Why: "exited"}, nil
	}
	if err != nil {
		return Evidence{}, fmt.Errorf("pid %d: executable: %w", r.Pid, err)
	}
	if exe != r.Executable {
		ev.Liveness = Forged
		ev.Why = fmt.Sprintf("pid %d runs %s, the record says %s", r.Pid, exe, r.Executable)
		return ev, nil
	}
	ok, err := procEnvHas(r.Pid, TokenEnv+"="+r.Token)
	if errors.Is(err, errNoProcess) {
		return Evidence{Liveness: Gone, Pid: r.Pid, Why: "exited"}, nil
	}
	if err != nil {
		return Evidence{}, fmt.Errorf("pid %d: environment: %w", r.Pid, err)
	}
	if !ok {
		ev.Liveness = Forged
		ev.Why = fmt.Sprintf("pid %d does not carry the workload's token: it is not the process the record names", r.Pid)
		return ev, nil
	}
	if st.Session != r.Pid {
		ev.Liveness = Forged
		ev.Why = fmt.Sprintf("pid %d does not lead its own session, as every native instance does", r.Pid)
		return ev, nil
	}
	ev.Liveness = Alive
	return ev, nil
}

// sameExecutable reports whether exe (from /proc/<pid>/exe, links
// resolved) is command (as configured, possibly through a link).
func sameExecutable(exe, command string) bool {
	if exe == command {
		return true
	}
	resolved, err := filepath.EvalSymlinks(command)
	return err == nil && resolved == exe
}
