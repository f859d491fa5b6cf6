package mesh

import (
	"errors"
	"fmt"
	"testing"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

func TestGracefulClose(t *testing.T) {
	noErr := quic.ApplicationErrorCode(http3.ErrCodeNoError)
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"the peer closed in order", &quic.ApplicationError{Remote: true, ErrorCode: noErr}, true},
		{"wrapped, as a body read returns it", fmt.Errorf("read: %w", &http3.Error{Remote: true, ErrorCode: http3.ErrCodeNoError}), true},
		{"we closed it ourselves", &quic.ApplicationError{Remote: false, ErrorCode: noErr}, false},
		{"the peer reset the stream", &http3.Error{Remote: true, ErrorCode: http3.ErrCodeRequestCanceled}, false},
		{"the peer died (idle timeout)", &quic.IdleTimeoutError{}, false},
		{"anything else", errors.New("boom"), false},
		{"nil", nil, false},
	}
	for _, tt := range tests {
		if got := GracefulClose(tt.err); got != tt.want {
			t.Errorf("%s: GracefulClose(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}
