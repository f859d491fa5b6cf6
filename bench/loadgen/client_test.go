package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server answers POST / with body, framed with Content-Length, chunked, or
// as SSE events flushed one by one.
func server(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/length":
			w.Header().Set("Content-Length", fmt.Sprint(len(body)))
			_, _ = w.Write(body)
		case "/chunked":
			w.WriteHeader(200)
			_, _ = w.Write(body[:1])
			w.(http.Flusher).Flush()
			_, _ = w.Write(body[1:])
		case "/close":
			w.Header().Set("Connection", "close")
			_, _ = w.Write(body)
		case "/sse":
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, ": keep-alive\n\n")
			for i := range 3 {
				w.(http.Flusher).Flush()
				fmt.Fprintf(w, "data: {\"i\":%d,\"pad\":%q}\n\n", i, strings.Repeat("x", i*5000))
			}
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
		case "/sse-cut":
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {}\n\n")
		default:
			http.Error(w, "nope", http.StatusTeapot)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestDo(t *testing.T) {
	srv := server(t)
	addr := strings.TrimPrefix(srv.URL, "http://")
	for _, tc := range []struct {
		path       string
		wantStatus int
		wantErr    bool
	}{
		{"/length", 200, false},
		{"/chunked", 200, false},
		{"/close", 200, true}, // the generator must notice a connection it cannot reuse
		{"/other", 418, false},
	} {
		t.Run(tc.path, func(t *testing.T) {
			cn, err := dial(context.Background(), addr)
			if err != nil {
				t.Fatal(err)
			}
			defer cn.Close()
			req := buildRequest(addr, tc.path, []byte(`{"model":"m"}`))
			for i := range 2 { // twice on one connection: keep-alive framing
				var body []byte
				st, err := cn.do(req, &body)
				if st != tc.wantStatus || (err != nil) != tc.wantErr {
					t.Fatalf("do #%d = %d, %v; want %d, error %v", i, st, err, tc.wantStatus, tc.wantErr)
				}
				if tc.wantErr {
					return
				}
				if st == 200 && string(body) != `{"model":"m"}` {
					t.Errorf("body = %q, want the request echoed", body)
				}
				if st, err := cn.do(req, nil); st != tc.wantStatus || err != nil {
					t.Fatalf("do (discarding) = %d, %v", st, err)
				}
			}
		})
	}
}

func TestStream(t *testing.T) {
	srv := server(t)
	addr := strings.TrimPrefix(srv.URL, "http://")
	cn, err := dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer cn.Close()
	for i := range 2 {
		var got []frame
		st, err := cn.stream(buildRequest(addr, "/sse", []byte(`{}`)), true, func(f frame) { got = append(got, f) })
		if st != 200 || err != nil {
			t.Fatalf("stream #%d = %d, %v", i, st, err)
		}
		if len(got) != 4 || !got[3].done || got[2].done {
			t.Fatalf("stream #%d: %d frames (last done %v), want 3 data events and [DONE]", i, len(got), len(got) > 0 && got[len(got)-1].done)
		}
		if want := fmt.Sprintf(`{"i":2,"pad":%q}`, strings.Repeat("x", 10000)); string(got[2].data) != want {
			t.Errorf("frame 2 = %.40q..., want the 10 kB event whole", got[2].data)
		}
	}
	if _, err := cn.stream(buildRequest(addr, "/sse-cut", []byte(`{}`)), false, func(frame) {}); err == nil {
		t.Error("stream without [DONE]: no error, want one")
	}
}

func TestPctsAndStat(t *testing.T) {
	ds := make([]time.Duration, 0, 100)
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Microsecond)
	}
	if got := pcts(ds); got.P50 != 51*time.Microsecond || got.P99 != 100*time.Microsecond || got.N != 100 {
		t.Errorf("pcts(1..100 µs) = %+v, want p50 51µs, p99 100µs", got)
	}
	if got := stat([]float64{3, 1, 2, 10}); got.Med != 2.5 || got.Min != 1 || got.Max != 10 {
		t.Errorf("stat = %+v, want median 2.5, min 1, max 10", got)
	}
	if got := thousands(1234567); got != "1,234,567" {
		t.Errorf("thousands(1234567) = %q", got)
	}
}
