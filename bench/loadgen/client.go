package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http/httputil"
	"strconv"
	"time"
)

// The load generator speaks HTTP/1.1 itself over plain TCP connections: a
// request is a prebuilt byte slice, a response is parsed just enough to find
// its end. net/http's client would add tens of microseconds of its own work
// per request on the same two cores the contenders run on; this keeps the
// generator's share small and identical for every contender.

// conn is one keep-alive HTTP/1.1 connection. Not safe for concurrent use.
type conn struct {
	c  net.Conn
	br *bufio.Reader
}

// dial opens a connection to addr (host:port).
func dial(ctx context.Context, addr string) (*conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	return &conn{c: c, br: bufio.NewReaderSize(c, 8<<10)}, nil
}

func (c *conn) Close() error { return c.c.Close() }

// buildRequest returns a POST request for path on addr with a JSON body,
// with the headers an OpenAI SDK sends.
func buildRequest(addr, path string, body []byte) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "POST %s HTTP/1.1\r\n", path)
	fmt.Fprintf(&b, "Host: %s\r\n", addr)
	b.WriteString("User-Agent: infermesh-bench/1\r\n")
	b.WriteString("Accept: application/json\r\n")
	b.WriteString("Content-Type: application/json\r\n")
	b.WriteString("Authorization: Bearer sk-bench\r\n")
	fmt.Fprintf(&b, "Content-Length: %d\r\n\r\n", len(body))
	b.Write(body)
	return b.Bytes()
}

// respHead is what the generator needs from a response head.
type respHead struct {
	status        int
	contentLength int64 // -1 when absent
	chunked       bool
	close         bool
	retryAfter    bool // a Retry-After header came with it
}

var errBadResponse = errors.New("malformed HTTP response")

// readHead reads a status line and the header block.
func (c *conn) readHead() (respHead, error) {
	h := respHead{contentLength: -1}
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return h, err
	}
	// "HTTP/1.1 200 OK\r\n"
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) {
		return h, fmt.Errorf("%w: status line %q", errBadResponse, line)
	}
	st, err := strconv.Atoi(string(line[9:12]))
	if err != nil {
		return h, fmt.Errorf("%w: status line %q", errBadResponse, line)
	}
	h.status = st
	for {
		line, err = c.br.ReadSlice('\n')
		if err != nil {
			return h, err
		}
		if len(line) <= 2 { // "\r\n"
			return h, nil
		}
		colon := bytes.IndexByte(line, ':')
		if colon < 0 {
			return h, fmt.Errorf("%w: header line %q", errBadResponse, line)
		}
		name, val := line[:colon], bytes.TrimSpace(line[colon+1:])
		switch {
		case asciiEqualFold(name, "content-length"):
			n, err := strconv.ParseInt(string(val), 10, 64)
			if err != nil || n < 0 {
				return h, fmt.Errorf("%w: content-length %q", errBadResponse, val)
			}
			h.contentLength = n
		case asciiEqualFold(name, "transfer-encoding"):
			h.chunked = bytes.Contains(bytes.ToLower(val), []byte("chunked"))
		case asciiEqualFold(name, "connection"):
			h.close = bytes.Contains(bytes.ToLower(val), []byte("close"))
		case asciiEqualFold(name, "retry-after"):
			h.retryAfter = true
		}
	}
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// do sends req and reads the whole response. keep, when not nil, receives
// the body (for checks); otherwise the body is discarded.
func (c *conn) do(req []byte, keep *[]byte) (status int, err error) {
	if _, err := c.c.Write(req); err != nil {
		return 0, err
	}
	h, err := c.readHead()
	if err != nil {
		return 0, err
	}
	var body io.Reader
	switch {
	case h.chunked:
		body = httputil.NewChunkedReader(c.br)
	case h.contentLength >= 0:
		if keep == nil {
			if _, err := c.br.Discard(int(h.contentLength)); err != nil {
				return h.status, err
			}
			return h.status, closeIf(h)
		}
		body = io.LimitReader(c.br, h.contentLength)
	default:
		return h.status, fmt.Errorf("%w: neither content-length nor chunked", errBadResponse)
	}
	if keep != nil {
		b, err := io.ReadAll(body)
		*keep = b
		if err != nil {
			return h.status, err
		}
	} else if _, err := io.Copy(io.Discard, body); err != nil {
		return h.status, err
	}
	if h.chunked {
		if err := c.readTrailer(); err != nil {
			return h.status, err
		}
	}
	return h.status, closeIf(h)
}

// readTrailer consumes the trailer section after a chunked body's last
// chunk (which httputil's chunked reader leaves unread).
func (c *conn) readTrailer() error {
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return err
		}
		if len(line) <= 2 {
			return nil
		}
	}
}

var errServerClose = errors.New("server closed the keep-alive connection")

func closeIf(h respHead) error {
	if h.close {
		return errServerClose
	}
	return nil
}

// frame is one SSE data event as the generator saw it.
type frame struct {
	at   time.Time
	done bool   // data: [DONE]
	data []byte // only filled when keepData
}

// stream sends a streaming request and calls onFrame for every data event
// as it arrives. It returns after [DONE] and the end of the body, the
// connection staying usable when the server keeps it alive.
func (c *conn) stream(req []byte, keepData bool, onFrame func(frame)) (status int, err error) {
	h, err := c.streamHead(req, keepData, onFrame)
	return h.status, err
}

// streamHead is stream returning the whole response head (status 0: none
// came).
func (c *conn) streamHead(req []byte, keepData bool, onFrame func(frame)) (respHead, error) {
	if _, err := c.c.Write(req); err != nil {
		return respHead{}, err
	}
	h, err := c.readHead()
	if err != nil {
		return respHead{}, err
	}
	if h.status != 200 {
		_, _ = c.drain(h)
		return h, fmt.Errorf("status %d", h.status)
	}
	var body io.Reader
	switch {
	case h.chunked:
		body = httputil.NewChunkedReader(c.br)
	case h.contentLength >= 0:
		body = io.LimitReader(c.br, h.contentLength)
	default:
		body = c.br // delimited by close
		h.close = true
	}
	lr := bufio.NewReaderSize(body, 4<<10)
	var line []byte
	sawDone := false
	for {
		part, err := lr.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			line = append(line, part...)
			continue
		}
		if len(line) > 0 {
			line = append(line, part...)
			part = line
		}
		if len(part) > 0 && err == nil {
			if bytes.HasPrefix(part, []byte("data:")) {
				f := frame{at: time.Now()}
				d := bytes.TrimSpace(part[5:])
				f.done = string(d) == "[DONE]"
				sawDone = sawDone || f.done
				if keepData {
					f.data = append([]byte(nil), d...)
				}
				onFrame(f)
			}
		}
		line = line[:0]
		if err == io.EOF {
			break
		}
		if err != nil {
			return h, err
		}
	}
	if !sawDone {
		return h, errors.New("stream ended without data: [DONE]")
	}
	if h.chunked {
		if err := c.readTrailer(); err != nil {
			return h, err
		}
	}
	return h, closeIf(h)
}

func (c *conn) drain(h respHead) (int64, error) {
	switch {
	case h.chunked:
		n, err := io.Copy(io.Discard, httputil.NewChunkedReader(c.br))
		if err == nil {
			err = c.readTrailer()
		}
		return n, err
	case h.contentLength >= 0:
		n, err := c.br.Discard(int(h.contentLength))
		return int64(n), err
	}
	return 0, nil
}
