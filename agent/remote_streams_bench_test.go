package agent

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkRemoteOpenStreams holds n SSE streams open through the remote
// hop (client -> agent a -> QUIC -> agent b -> instance, every part in this
// process) and reports what they hold once every stream has its first
// event: heap in use, goroutine stacks and goroutines, per stream, over the
// same process before they were opened. direct is the same streams straight
// to the instance: the client's and the instance's share, to subtract. Each
// stream is a raw HTTP/1.1 connection read by one goroutine with a small
// buffer. With INFERMESH_PROFILE_DIR set it writes heap and goroutine
// profiles there (heap-<path>-<n>.pprof, goroutine-<path>-<n>.txt) for go
// tool pprof. Every stream holds four sockets in this one process, so the
// levels stop at 2048 (bench/run.sh runs 4096 with the agents apart).
//
//	go test -run '^$' -bench RemoteOpenStreams -benchtime 1x ./agent/
func BenchmarkRemoteOpenStreams(b *testing.B) {
	up := startUpstream(b, "demo", 500*time.Millisecond)
	tm := newTestMesh(b, "a", "b")
	na := tm.start("a", map[string]roleSpec{"chat": {acceptFrom: []string{"b"}}}, false)
	tm.start("b", map[string]roleSpec{"chat": {upstream: up, model: "demo", expose: true, serveTo: []string{"a"}}}, false)
	waitFor(b, "a resolves chat to b", func() bool { return na.resolvesTo("chat", "b") })
	paths := []struct{ name, addr, model string }{
		{"direct", strings.TrimPrefix(up.base, "http://"), "demo"},
		{"remote", strings.TrimPrefix(na.url("chat"), "http://"), "chat"},
	}
	for _, p := range paths {
		body := `{"model":"` + p.model + `","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":400}`
		req := "POST /v1/chat/completions HTTP/1.1\r\nHost: " + p.addr + "\r\nContent-Type: application/json\r\nContent-Length: " +
			strconv.Itoa(len(body)) + "\r\n\r\n" + body
		for _, n := range []int{1024, 2048} {
			b.Run(fmt.Sprintf("%s/n=%d", p.name, n), func(b *testing.B) {
				for range b.N {
					holdStreams(b, p.name, p.addr, req, n)
				}
			})
		}
	}
}

func holdStreams(b *testing.B, name, addr, req string, n int) {
	// Twice: sync.Pool's victim cache survives one collection, and what
	// pools hold is not what the streams hold.
	runtime.GC()
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	g0 := runtime.NumGoroutine()
	first := make(chan error, n)
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		// The next level starts once these streams are gone everywhere
		// (each holds four sockets in this process).
		waitFor(b, "the streams closed", func() bool { return runtime.NumGoroutine() <= g0+16 })
	}()
	// Opened at 1000/s, as bench/run.sh's concurrent-streams workload.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for range n {
		<-tick.C
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write([]byte(req)); err != nil {
			b.Fatal(err)
		}
		go func() {
			br := bufio.NewReaderSize(c, 256)
			line, err := br.ReadString('\n')
			if err == nil && !strings.Contains(line, " 200 ") {
				rest := make([]byte, 512)
				k, _ := io.ReadAtLeast(br, rest, 1)
				err = fmt.Errorf("%q %q", line, rest[:k])
			}
			for err == nil { // until the first event
				if line, err = br.ReadString('\n'); strings.HasPrefix(line, "data:") {
					break
				}
			}
			first <- err
			buf := make([]byte, 256)
			for err == nil {
				_, err = c.Read(buf)
			}
		}()
	}
	for range n {
		select {
		case err := <-first:
			if err != nil {
				b.Fatal(err)
			}
		case <-time.After(60 * time.Second):
			b.Fatal("streams did not all start within 60 s")
		}
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	g1 := runtime.NumGoroutine()
	per := func(a, z uint64) float64 { return (float64(z) - float64(a)) / float64(n) / 1024 }
	b.ReportMetric(per(before.HeapInuse, after.HeapInuse), "heap-KiB/stream")
	b.ReportMetric(per(before.StackInuse, after.StackInuse), "stack-KiB/stream")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/stream")
	b.ReportMetric(per(before.Sys, after.Sys), "sys-KiB/stream")
	if dir := os.Getenv("INFERMESH_PROFILE_DIR"); dir != "" {
		writeProfile(b, filepath.Join(dir, fmt.Sprintf("heap-%s-%d.pprof", name, n)), "heap", 0)
		writeProfile(b, filepath.Join(dir, fmt.Sprintf("goroutine-%s-%d.txt", name, n)), "goroutine", 1)
	}
}

func writeProfile(b *testing.B, path, name string, debug int) {
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup(name).WriteTo(f, debug); err != nil {
		b.Fatal(err)
	}
}
