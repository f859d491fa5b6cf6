// Command e2eload is the cluster harness's load generator (package e2e):
// it runs on a host of the test cluster, as an application would, and
// sends chat completions to the agent's loopback proxy for a while,
// streams and plain requests alike, from a few workers at once. Every
// request is one JSON line on the output: when it started and ended, when
// its first byte came, and how it ended:
//
//	ok         a plain answer with 200, or a stream that ended with [DONE]
//	failed     no answer: an error or a non-200 status before any byte
//	aborted    a stream cut mid-way with a clear error (the client sees it)
//	clean_cut  a stream that ended without [DONE] yet without an error: a
//	           truncated answer passed off as complete (must never happen)
//
// It exits when the duration is over and every request ended.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// Record is one request's outcome (one line of output).
type Record struct {
	Worker int    `json:"worker"`
	Stream bool   `json:"stream"`
	Start  int64  `json:"start"` // unix ns
	First  int64  `json:"first"` // unix ns of the response header; 0 when none came
	End    int64  `json:"end"`   // unix ns
	Events int    `json:"events,omitempty"`
	Result string `json:"result"`
	Err    string `json:"err,omitempty"`
}

func main() {
	url := flag.String("url", "http://127.0.0.1:18080/v1/chat/completions", "the proxy's chat completions URL")
	dur := flag.Duration("duration", 20*time.Second, "how long to start new requests, at most")
	stopFile := flag.String("stop-file", "", "stop starting new requests once this file exists")
	workers := flag.Int("workers", 6, "concurrent workers; odd ones stream")
	tokens := flag.Int("stream-tokens", 40, "max_tokens of a stream")
	timeout := flag.Duration("timeout", 60*time.Second, "bound of one request")
	out := flag.String("out", "-", "output file (- is stdout)")
	flag.Parse()

	w := os.Stdout
	if *out != "-" {
		f, err := os.Create(*out + ".tmp")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer func() {
			f.Close()
			if err := os.Rename(*out+".tmp", *out); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
		}()
		w = f
	}
	var mu sync.Mutex
	enc := json.NewEncoder(w)
	client := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: *workers}}
	stop := time.Now().Add(*dur)
	var wg sync.WaitGroup
	for i := range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) && !exists(*stopFile) {
				r := one(client, *url, i, i%2 == 1, *tokens, *timeout)
				mu.Lock()
				_ = enc.Encode(r)
				mu.Unlock()
				if r.Result == "failed" {
					time.Sleep(20 * time.Millisecond) // no hot loop against a refusing proxy
				}
			}
		}()
	}
	wg.Wait()
}

func one(client *http.Client, url string, worker int, stream bool, tokens int, timeout time.Duration) (r Record) {
	r = Record{Worker: worker, Stream: stream, Start: time.Now().UnixNano()}
	defer func() { r.End = time.Now().UnixNano() }()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	max := 4
	if stream {
		max = tokens
	}
	body := fmt.Sprintf(`{"model":"chat","stream":%v,"max_tokens":%d,"messages":[{"role":"user","content":"e2e"}]}`, stream, max)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		r.Result, r.Err = "failed", err.Error()
		return r
	}
	defer resp.Body.Close()
	r.First = time.Now().UnixNano()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		r.Result, r.Err = "failed", fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
		return r
	}
	if !stream {
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			r.Result, r.Err = "aborted", err.Error()
			return r
		}
		r.Result = "ok"
		return r
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadString('\n')
		if strings.HasPrefix(line, "data: ") {
			if strings.HasPrefix(line, "data: [DONE]") {
				r.Result = "ok"
				return r
			}
			r.Events++
			if strings.Contains(line, `"error"`) {
				r.Result, r.Err = "aborted", "error event: "+strings.TrimSpace(line)
				return r
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				r.Result = "clean_cut"
			} else {
				r.Result, r.Err = "aborted", err.Error()
			}
			return r
		}
	}
}

func exists(path string) bool {
	if path == "" {
		return false
	}
	_, err := os.Stat(path)
	return err == nil
}
