package mesh

import (
	"errors"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// GracefulClose reports whether err ended a request because the peer
// closed its connection gracefully (H3_NO_ERROR): it stopped, drained what
// it could and went away. A request cut that way is told apart from a peer
// that failed: the peer is not to blame for its own orderly exit, and the
// peer scorer does not cool it down for it.
func GracefulClose(err error) bool {
	if e, ok := errors.AsType[*http3.Error](err); ok {
		return e.Remote && e.ErrorCode == http3.ErrCodeNoError
	}
	if e, ok := errors.AsType[*quic.ApplicationError](err); ok {
		return e.Remote && e.ErrorCode == quic.ApplicationErrorCode(http3.ErrCodeNoError)
	}
	return false
}
