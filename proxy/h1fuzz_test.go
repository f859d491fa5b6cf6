package proxy

import (
	"io"
	"testing"
)

// FuzzH1ParseRequest feeds arbitrary bytes to the request reader: it must
// never panic, and what it accepts must be self-consistent.
func FuzzH1ParseRequest(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
		"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\ncontent-type: application/json\r\nContent-Length: 2\r\n\r\n{}",
		"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: 1\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
		"GET http://localhost/p HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
		"\r\nOPTIONS * HTTP/1.1\nHost: h\n\n",
		"GET /%41%zz HTTP/1.1\r\nHost: h\r\n\r\n",
		"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c := newFuzzConn(data, 64)
		c.s.cfg.MaxHeaderBytes = 1 << 10
		for i := 0; i < 3; i++ { // a few requests, as on a kept-alive connection
			r, herr := c.readRequest()
			if herr != nil {
				if herr.status != 0 && (herr.status < 400 || herr.status > 599) {
					t.Fatalf("error status %d", herr.status)
				}
				return
			}
			if !validToken(r.Method) || r.URL == nil || r.Header == nil || r.Body == nil {
				t.Fatalf("accepted an inconsistent request: %+v", r)
			}
			if _, ok := r.Header["Host"]; ok {
				t.Fatal("Host left in the header map")
			}
			for k, vv := range r.Header {
				if canonicalKey(k) != k || !validToken(k) {
					t.Fatalf("header key %q not canonical", k)
				}
				for _, v := range vv {
					if !validValue(v) || v != trimOWS(v) {
						t.Fatalf("header value %q", v)
					}
				}
			}
			switch {
			case r.ContentLength > 0 && len(r.TransferEncoding) > 0,
				r.ContentLength < 0 && len(r.TransferEncoding) == 0:
				t.Fatalf("framing: length %d, codings %v", r.ContentLength, r.TransferEncoding)
			}
			n, err := io.Copy(io.Discard, r.Body)
			if err == nil && r.ContentLength >= 0 && n != r.ContentLength {
				t.Fatalf("read %d body bytes, want %d", n, r.ContentLength)
			}
			if err != nil {
				return
			}
		}
	})
}
