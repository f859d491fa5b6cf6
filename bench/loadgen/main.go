// Command loadgen is infermesh's benchmark load generator. bench/run.sh
// starts the upstream (the demo model) and the contenders (the upstream
// itself, infermeshd, nginx, haproxy, ...), writes their addresses to a JSON
// file and runs loadgen on it. loadgen warms every contender up, runs each
// workload as interleaved repetitions (A B C D A B C D ...), takes the
// median over repetitions of each figure (and of each difference and ratio
// to the direct path and to nginx, computed within a repetition), measures
// mesh convergence through mesh/meshbench, and prints and writes a markdown
// and a JSON report.
//
// With -routing it runs the routing benchmark instead (routing.go): engines
// in engine mode behind a mesh of agents, described by bench/run.sh; its
// results go into a report of their own, or (-routing-out, then
// -routing-results) into the main one.
//
// It exits 1 when the harness breaks: a contender answers with an error, a
// response is malformed, or a stream is cut; in the routing benchmark, a
// run in which no request succeeds or an engine that cannot be read.
// Requests the routing rows fail are figures. Speed is never asserted.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Target is one endpoint of a contender: where to send requests and the
// model name to ask for.
type Target struct {
	Addr  string `json:"addr"`
	Model string `json:"model"`
}

// Contender is one path under test, as bench/run.sh describes it.
type Contender struct {
	// Name is the short name used in tables ("direct", "infermesh", ...).
	Name string `json:"name"`
	// Desc says what the path is.
	Desc string `json:"desc"`
	// Missing, when set, says why the contender is not measured
	// (e.g. "not built yet"); it is listed as n/a.
	Missing string `json:"missing,omitempty"`
	// Fast serves small completions at once; Stream streams the paced
	// deltas; Many streams the slow deltas of the concurrent-streams
	// workload.
	Fast   Target `json:"fast"`
	Stream Target `json:"stream"`
	Many   Target `json:"many"`
	// PIDs are the processes whose RSS is sampled while streams are open
	// and summed (none or 0: not sampled); infermesh-quic is two agents.
	PIDs []int `json:"pids"`
	// PIDNames name the PIDs in reports (optional).
	PIDNames []string `json:"pid_names,omitempty"`
	// PID is one more such process (the harness's older form).
	PID int `json:"pid,omitempty"`
	// CPUPIDs are the processes whose CPU (user + system, with their
	// descendants: nginx's master and its workers) is counted over each
	// c=64 repetition and divided by the requests it completed. The
	// direct contender's are the upstream's, which every row also reports.
	CPUPIDs []int `json:"cpu_pids,omitempty"`
}

// quicName is the remote-path contender: app -> agent a -> QUIC -> agent b
// -> instance.
const quicName = "infermesh-quic"

// pids returns the processes to sample, without zeros.
func (c Contender) pids() []int {
	var out []int
	for _, p := range append(slices.Clone(c.PIDs), c.PID) {
		if p > 0 && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

// Params are the workload sizes.
type Params struct {
	Quick        bool          `json:"quick"`
	Reps         int           `json:"reps"`
	Warmup       time.Duration `json:"warmup"`
	LatencyDur   time.Duration `json:"latency_dur"`
	ThroughDur   time.Duration `json:"throughput_dur"`
	Conc         int           `json:"concurrency"`
	StreamReps   int           `json:"stream_reps"`
	StreamDur    time.Duration `json:"stream_dur"`
	StreamConc   int           `json:"stream_concurrency"`
	StreamTokens int           `json:"stream_tokens"`
	StreamDelay  time.Duration `json:"stream_delay"`
	ManyLevels   []int         `json:"many_levels"`
	ManyTokens   int           `json:"many_tokens"`
	ManyDelay    time.Duration `json:"many_delay"`
	ManyRate     int           `json:"many_open_rate"`
	StallAfter   time.Duration `json:"stall_after"`
	MeshNodes    []int         `json:"mesh_nodes"`
	MeshTimeout  time.Duration `json:"mesh_timeout"`
	// SimNodes are the node counts of the in-memory mesh simulation
	// (mesh/meshsim), each bounded by SimTimeout.
	SimNodes   []int         `json:"sim_nodes"`
	SimTimeout time.Duration `json:"sim_timeout"`
	// BareH3 measures a bare HTTP/3 exchange at c=1 alongside the
	// contenders when infermesh-quic is among them.
	BareH3 bool `json:"bare_h3"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("loadgen", flag.ContinueOnError)
	contendersPath := fs.String("contenders", "", "JSON file listing the contenders (written by bench/run.sh)")
	outDir := fs.String("out", "bench/results", "directory for the markdown and JSON reports")
	quick := fs.Bool("quick", false, "the quick mode (under a minute; keeps the harness working)")
	instrPath := fs.String("instructions", "", "JSON file of instruction counts per contender (written by bench/run.sh) for the report")
	meta := fs.String("meta", "", "JSON object of extra facts for the report header (versions, ...)")
	harnessPath := fs.String("harness", "", "JSON file from bench/run.sh: its start time, the load average then, and its phases")
	var p Params
	fs.IntVar(&p.StreamTokens, "stream-tokens", 64, "deltas per stream of the streaming workload (the upstream's -tokens)")
	fs.DurationVar(&p.StreamDelay, "stream-delay", 20*time.Millisecond, "delay between deltas of the streaming workload (the upstream's -token-delay)")
	fs.IntVar(&p.ManyTokens, "many-tokens", 24, "deltas per stream of the concurrent-streams workload")
	fs.DurationVar(&p.ManyDelay, "many-delay", 250*time.Millisecond, "delay between deltas of the concurrent-streams workload")
	skipMesh := fs.Bool("skip-mesh", false, "do not measure mesh convergence")
	manyLevels := fs.String("many-levels", "", "comma-separated concurrent-streams levels instead of the mode's (e.g. 2048,512)")
	fs.BoolVar(&p.BareH3, "bare-h3", true, "with infermesh-quic among the contenders, also measure a bare HTTP/3 exchange (two mesh transports in this process) at c=1")
	fixed := fs.Int("fixed", 0, "send this many small chat completions to -addr, one at a time over one connection, and exit (the instruction-count workload)")
	fixedAddr := fs.String("addr", "", "with -fixed: host:port")
	fixedModel := fs.String("model", "demo", "with -fixed: the model to ask for")
	freePorts := fs.Int("free-ports", 0, "print this many free loopback TCP ports and exit (for bench/run.sh)")
	routingPath := fs.String("routing", "", "run the routing benchmark on the topologies this JSON file describes (written by bench/run.sh), alone")
	routingOut := fs.String("routing-out", "", "with -routing: write the results to this JSON file for a later -routing-results, instead of a report")
	routingResults := fs.String("routing-results", "", "JSON file of routing results (from -routing-out) to include in the report")
	rw := defaultRoutingWorkload()
	fs.StringVar(&rw.Popularity, "routing-popularity", rw.Popularity, "routing workload: tenant popularity, uniform or zipf")
	fs.Float64Var(&rw.ZipfS, "routing-zipf-s", rw.ZipfS, "routing workload: the Zipf exponent")
	fs.IntVar(&rw.Turns, "routing-turns", rw.Turns, "routing workload: turns per conversation (later turns repeat the history)")
	fs.Uint64Var(&rw.Seed, "routing-seed", rw.Seed, "routing workload: the seed of tenants, queries, popularity and arrivals")
	routingRates := fs.String("routing-rates", "", "routing: comma-separated fractions of capacity instead of 0.5,1,1.3")
	routingWindow := fs.Duration("routing-window", 0, "routing: each run's measured window instead of the mode's")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *freePorts > 0 {
		return printFreePorts(*freePorts)
	}
	if *fixed > 0 {
		return fixedRequests(ctx, *fixedAddr, *fixedModel, *fixed)
	}
	extra := udpFacts()
	if *meta != "" {
		if err := json.Unmarshal([]byte(*meta), &extra); err != nil {
			return fmt.Errorf("-meta: %w", err)
		}
	}
	if *routingPath != "" {
		rp := routingParams(*quick)
		if *routingRates != "" {
			rates, err := parseFloats(*routingRates)
			if err != nil {
				return fmt.Errorf("-routing-rates: %w", err)
			}
			rp.Rates = rates
		}
		if *routingWindow > 0 {
			rp.Window = *routingWindow
		}
		var spec RoutingSpec
		if err := readJSON(*routingPath, &spec); err != nil {
			return err
		}
		if err := checkRoutingSpec(spec); err != nil {
			return err
		}
		started := time.Now()
		res, err := runRouting(ctx, spec, rw, rp)
		if err != nil {
			return err
		}
		if *routingOut != "" {
			js, err := json.MarshalIndent(res, "", "  ")
			if err != nil {
				return err
			}
			return os.WriteFile(*routingOut, js, 0o644)
		}
		var h Harness
		if *harnessPath != "" {
			if err := readJSON(*harnessPath, &h); err != nil {
				return err
			}
		}
		return writeReport(routingReport(started, *quick, extra, h, res), *outDir)
	}
	if *contendersPath == "" {
		return errors.New("-contenders (or -routing) is required")
	}
	var cs []Contender
	if err := readJSON(*contendersPath, &cs); err != nil {
		return err
	}
	if len(cs) == 0 || cs[0].Name != "direct" || cs[0].Missing != "" {
		return errors.New("the first contender must be the measured direct path")
	}
	var routing *RoutingResults
	if *routingResults != "" {
		routing = &RoutingResults{}
		if err := readJSON(*routingResults, routing); err != nil {
			return err
		}
	}

	p.Quick = *quick
	p.Conc = 64
	p.StreamConc = 16
	p.StallAfter = time.Second
	if p.Quick {
		p.Reps, p.Warmup, p.LatencyDur, p.ThroughDur = 2, 200*time.Millisecond, 250*time.Millisecond, 250*time.Millisecond
		p.StreamReps, p.StreamDur = 1, time.Duration(p.StreamTokens)*p.StreamDelay/2
		p.ManyLevels, p.ManyRate = []int{512}, 1000
		p.MeshNodes, p.MeshTimeout = []int{10}, 20*time.Second
		p.SimNodes, p.SimTimeout = []int{100}, 4*time.Minute
	} else {
		p.Reps, p.Warmup, p.LatencyDur, p.ThroughDur = 7, 2*time.Second, 1500*time.Millisecond, 1500*time.Millisecond
		p.StreamReps, p.StreamDur = 3, 2*time.Duration(p.StreamTokens)*p.StreamDelay
		p.ManyLevels, p.ManyRate = []int{4096, 2048, 512}, 1000
		p.MeshNodes, p.MeshTimeout = []int{10, 50, 100}, 75*time.Second
		p.SimNodes, p.SimTimeout = []int{100, 300, 1000}, 45*time.Minute
	}
	if *skipMesh {
		p.MeshNodes, p.SimNodes = nil, nil
	}
	if *manyLevels != "" {
		p.ManyLevels = nil
		for _, f := range strings.Split(*manyLevels, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				return fmt.Errorf("-many-levels: %q is not a positive number", f)
			}
			p.ManyLevels = append(p.ManyLevels, n)
		}
	}

	b := newBench(cs, p)
	if err := b.check(ctx); err != nil {
		return err
	}
	b.runAll(ctx)
	if err := ctx.Err(); err != nil {
		return err
	}
	var h Harness
	var instr []instrCount
	for path, v := range map[string]any{*harnessPath: &h, *instrPath: &instr} {
		if path == "" {
			continue
		}
		if err := readJSON(path, v); err != nil {
			return err
		}
	}
	rep := b.report(extra, h, instr, routing)
	if err := writeReport(rep, *outDir); err != nil {
		return err
	}
	if n := rep.Errors(); n > 0 {
		return fmt.Errorf("the harness saw %d error(s); see the report", n)
	}
	if p.Quick {
		// The quick mode keeps the mesh measurement working too (a full
		// run reports a slow or failed convergence as a result).
		for _, m := range rep.Mesh {
			if m.Err != "" {
				return fmt.Errorf("mesh convergence at N=%d failed: %s", m.N, m.Err)
			}
		}
		// A simulation that ran out of time is the host's doing (a
		// hundred nodes share its cores) and stays a reported result;
		// any other failure is the harness's.
		for _, m := range rep.Sim {
			if m.Err != "" && !strings.Contains(m.Err, context.DeadlineExceeded.Error()) {
				return fmt.Errorf("mesh simulation at N=%d failed: %s", m.N, m.Err)
			}
		}
	}
	return nil
}

// writeReport prints the report's markdown and writes it, with its JSON,
// to outDir: <started>-<mode>.md and .json, and latest-<mode>.md and .json.
func writeReport(rep *Report, outDir string) error {
	md := rep.Markdown()
	fmt.Print(md)
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	stamp := rep.Started.UTC().Format("20060102-150405")
	base := filepath.Join(outDir, stamp+"-"+rep.Mode)
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	for path, data := range map[string][]byte{
		base + ".md": []byte(md), base + ".json": js,
		filepath.Join(outDir, "latest-"+rep.Mode+".md"): []byte(md), filepath.Join(outDir, "latest-"+rep.Mode+".json"): js,
	} {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			return err
		}
	}
	fmt.Printf("\nwritten: %s.md, %s.json\n", base, base)
	return nil
}

// parseFloats parses a comma-separated list of positive numbers.
func parseFloats(s string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// readJSON decodes the JSON file at path into v.
func readJSON(path string, v any) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// printFreePorts prints n distinct loopback ports that were free a moment
// ago for TCP and UDP on 127.0.0.1 and 127.0.0.2, one a line. They are
// taken below the kernel's ephemeral range when it leaves room, so that
// the outgoing connections of other work on the host cannot take one
// between now and the contender's bind (seen: nginx "Address already in
// use" on a shared host).
func printFreePorts(n int) error {
	var held []io.Closer
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	lo, hi := 20000, ephemeralLow()-1
	if hi-lo < 4*n {
		lo, hi = 0, 0 // no room below: let the kernel choose
	}
	var got []int
	for tries := 0; len(got) < n; tries++ {
		if tries > 100*n {
			return fmt.Errorf("found only %d free ports of %d", len(got), n)
		}
		port := 0
		if hi > 0 {
			port = lo + rand.IntN(hi-lo+1)
		}
		cs, p, err := holdPort(port)
		if err != nil {
			if hi == 0 {
				return err
			}
			continue
		}
		held = append(held, cs...)
		got = append(got, p)
	}
	for _, p := range got {
		fmt.Println(p)
	}
	return nil
}

// holdPort binds port (0: one the kernel picks) for TCP on 127.0.0.1 and
// UDP on 127.0.0.1 and 127.0.0.2 and returns what holds it.
func holdPort(port int) ([]io.Closer, int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return nil, 0, err
	}
	held := []io.Closer{ln}
	port = ln.Addr().(*net.TCPAddr).Port
	for _, host := range []string{"127.0.0.1", "127.0.0.2"} {
		pc, err := net.ListenPacket("udp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			for _, c := range held {
				c.Close()
			}
			return nil, 0, err
		}
		held = append(held, pc)
	}
	return held, port, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768
	}
	v, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return v
}
