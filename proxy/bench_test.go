package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// The benchmarks below drive the real proxy over loopback with the demo
// model (zero delay) behind it, through raw keep-alive HTTP/1.1 connections
// (so the client's own cost stays small). They are for profiling
// (-cpuprofile, -memprofile, -benchmem); timings are never asserted, and
// bench/run.sh is where paths are compared.

const benchChatBody = `{"model":"chat","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say hello in five words."}],"max_tokens":16,"temperature":0}`

func benchRequest(addr string, body string) []byte {
	return []byte("POST /v1/chat/completions HTTP/1.1\r\nHost: " + addr +
		"\r\nUser-Agent: infermesh-bench/1\r\nAccept: application/json\r\nContent-Type: application/json\r\nAuthorization: Bearer sk-bench\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}

// rawRoundTrip writes req and reads one response, returning its status.
func rawRoundTrip(c net.Conn, br *bufio.Reader, req []byte) (int, error) {
	if _, err := c.Write(req); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, err
}

func benchEnv(b *testing.B) string {
	b.Helper()
	e := newEnv(b, Config{})
	e.demo(0)
	return strings.TrimPrefix(e.url, "http://")
}

// BenchmarkProxyChat is one small non-streaming chat completion at a time
// through the proxy (model pinned and rewritten back).
func BenchmarkProxyChat(b *testing.B) {
	addr := benchEnv(b)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	req := benchRequest(addr, benchChatBody)
	b.ReportAllocs()
	for b.Loop() {
		if st, err := rawRoundTrip(c, br, req); err != nil || st != 200 {
			b.Fatalf("status %d, err %v", st, err)
		}
	}
}

// BenchmarkProxyChatParallel is the same with many connections at once.
func BenchmarkProxyChatParallel(b *testing.B) {
	addr := benchEnv(b)
	req := benchRequest(addr, benchChatBody)
	b.ReportAllocs()
	b.SetParallelism(32)
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for pb.Next() {
			if st, err := rawRoundTrip(c, br, req); err != nil || st != 200 {
				b.Errorf("status %d, err %v", st, err)
				return
			}
		}
	})
}

// BenchmarkProxyStream is one streamed completion (16 deltas, no delay) at
// a time: the per-event relay and rewrite cost.
func BenchmarkProxyStream(b *testing.B) {
	addr := benchEnv(b)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	req := benchRequest(addr, `{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	b.ReportAllocs()
	for b.Loop() {
		if st, err := rawRoundTrip(c, br, req); err != nil || st != 200 {
			b.Fatalf("status %d, err %v", st, err)
		}
	}
}

// BenchmarkProxyChatRawUpstream is BenchmarkProxyChatParallel with an
// instance that answers canned bytes without parsing much, so a profile
// shows the proxy's own costs (its HTTP/1.1 server included) and little
// else.
func BenchmarkProxyChatRawUpstream(b *testing.B) {
	e := newEnv(b, Config{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	answer := []byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Mon, 30 Nov 2026 07:13:33 GMT\r\nContent-Length: 304\r\n\r\n" +
		`{"id":"chatcmpl-8b81ed84fdfdbea6","object":"chat.completion","created":1796022813,"model":"demo","choices":[{"index":0,"message":{"role":"assistant","content":"signed answers by","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":3,"total_tokens":11}}`)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 8<<10)
				for {
					// Requests are small and come one at a time per
					// connection: one read holds one whole request.
					if _, err := c.Read(buf); err != nil {
						return
					}
					if _, err := c.Write(answer); err != nil {
						return
					}
				}
			}()
		}
	}()
	e.register("http://"+ln.Addr().String(), "demo")
	addr := strings.TrimPrefix(e.url, "http://")
	req := benchRequest(addr, benchChatBody)
	b.ReportAllocs()
	b.SetParallelism(32)
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for pb.Next() {
			if st, err := rawRoundTrip(c, br, req); err != nil || st != 200 {
				b.Errorf("status %d, err %v", st, err)
				return
			}
		}
	})
}
