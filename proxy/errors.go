package proxy

import (
	"net/http"
	"strconv"

	"github.com/infermesh/infermesh/clients"
)

// APIError is an error in the OpenAI wire shape:
//
//	{"error":{"message":"...","type":"...","param":null,"code":"..."}}
//
// Status is the HTTP status it is sent with.
type APIError struct {
	Status  int
	Type    string
	Code    string
	Param   string
	Message string
	// RetryAfter, when positive, is sent as Retry-After (seconds): the
	// condition is expected to pass (an instance starting, memory freed).
	RetryAfter int
	// RetryAfterMs, when positive, is sent as retry-after-ms, which
	// OpenAI's SDKs prefer to Retry-After's whole seconds.
	RetryAfterMs int64
	// Headers are sent as well (a client's rate-limit headers).
	Headers []clients.Header
}

func (e *APIError) Error() string { return e.Message }

// The error types and codes infermesh answers with. Types follow OpenAI's
// vocabulary so SDKs map them to their own error classes.
const (
	typeInvalidRequest = "invalid_request_error"
	typeNotFound       = "not_found_error"
	typePermission     = "permission_error"
	typeServer         = "server_error"
	typeUnavailable    = "service_unavailable"
)

func errBadJSON(msg string) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "invalid_json", Message: msg}
}

func errModelNotFound(model, role string) *APIError {
	return &APIError{
		Status: http.StatusNotFound, Type: typeInvalidRequest, Code: "model_not_found", Param: "model",
		Message: "the model " + strconv.Quote(model) + " is not served on this port (role " + strconv.Quote(role) + ")",
	}
}

func errRoleNotFound(role string) *APIError {
	return &APIError{Status: http.StatusNotFound, Type: typeNotFound, Code: "role_not_found",
		Message: "role " + strconv.Quote(role) + " is not available"}
}

func errNotFound(path string) *APIError {
	return &APIError{Status: http.StatusNotFound, Type: typeNotFound, Code: "unknown_url",
		Message: "unknown endpoint " + strconv.Quote(path)}
}

func errMethod(method string) *APIError {
	return &APIError{Status: http.StatusMethodNotAllowed, Type: typeInvalidRequest, Code: "method_not_allowed",
		Message: "method " + method + " is not allowed here"}
}

// errBusy refuses a request whose body would take the proxy over its
// bound on body memory in flight.
func errBusy() *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "server_busy", RetryAfter: 1,
		Message: "request bodies in flight are at the proxy's memory bound; retry shortly"}
}

func errTooLarge(limit int64) *APIError {
	return &APIError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
		Message: "request body is larger than the limit of " + strconv.FormatInt(limit, 10) + " bytes"}
}

func errForbidden(msg string) *APIError {
	return &APIError{Status: http.StatusForbidden, Type: typePermission, Code: "forbidden", Message: msg}
}

// noInstanceRetryAfter is the Retry-After of a 503 for a role without an
// instance now: instances restart with seconds of backoff.
const noInstanceRetryAfter = 5

func errNoInstance(role string) *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "no_instance",
		Message: "no instance serves role " + strconv.Quote(role) + " right now", RetryAfter: noInstanceRetryAfter}
}

func errPeerRefused(peer, role, why string) *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "no_instance",
		Message: "no instance serves role " + role + " to this node: " + peer + " refused (" + why + ")"}
}

func errUpstream(msg string) *APIError {
	return &APIError{Status: http.StatusBadGateway, Type: typeServer, Code: "upstream_failed", Message: msg}
}

func errTimeout(msg string) *APIError {
	return &APIError{Status: http.StatusGatewayTimeout, Type: typeServer, Code: "upstream_timeout", Message: msg}
}

// appendError appends the JSON body of e.
func (e *APIError) appendJSON(b []byte) []byte {
	b = append(b, `{"error":{"message":`...)
	b = appendJSONString(b, e.Message)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, e.Type)
	b = append(b, `,"param":`...)
	if e.Param == "" {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, e.Param)
	}
	b = append(b, `,"code":`...)
	b = appendJSONString(b, e.Code)
	return append(b, "}}\n"...)
}

// WriteError sends e as an OpenAI-shaped JSON error response.
func WriteError(w http.ResponseWriter, e *APIError) {
	body := e.appendJSON(make([]byte, 0, 160))
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("X-Content-Type-Options", "nosniff")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	if e.RetryAfterMs > 0 {
		h["Retry-After-Ms"] = []string{strconv.FormatInt(e.RetryAfterMs, 10)}
	}
	for _, x := range e.Headers {
		h[x.Name] = []string{x.Value}
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}
