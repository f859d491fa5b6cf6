package proxy

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestCopyFlushAfterEmptiedPoolBuffer: copySSE returns its buffers to the
// stream pool emptied (len 0); a relay that gets one next must still copy
// (a zero-length read buffer spun forever, hanging every remote stream
// that followed a rewritten local one).
func TestCopyFlushAfterEmptiedPoolBuffer(t *testing.T) {
	for range 4 {
		b := make([]byte, 0, 4<<10)
		streamBufPool.Put(&b)
	}
	rec := httptest.NewRecorder()
	src := strings.NewReader("data: {\"x\":1}\n\ndata: [DONE]\n\n")
	n, err := copyFlush(rec, http.NewResponseController(rec), src, true)
	if err != nil || n != int64(src.Size()) || !bytes.Equal(rec.Body.Bytes(), []byte("data: {\"x\":1}\n\ndata: [DONE]\n\n")) {
		t.Fatalf("copyFlush = %d, %v; body %q", n, err, rec.Body.String())
	}
}
