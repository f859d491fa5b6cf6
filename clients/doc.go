// Package clients knows who is calling this host's proxy: the clients an
// operator registered (`infermesh clients add`), each with a key, the roles
// it may use, a priority and its limits, and the anonymous client that
// stands for a request without a key. It imports nothing of ours: the agent
// loads the clients from the state store and hands them to a Registry; the
// proxy asks the Registry to admit each app request and tells it what the
// request cost when it ends.
//
// # Words
//
// A key is the secret an app sends (`Authorization: Bearer im-…`, or
// `api-key: im-…`): 32 random bytes, base64url, behind the prefix "im-". It
// is shown once, when made; the agent keeps only its hash (SHA-256, which is
// enough for a key of 256 random bits: no dictionary to search) and a hint
// (its last four characters) to tell keys apart in a list. A client is named
// by the operator; "anonymous" is reserved for requests without a key, whose
// limits come from the config (proxy.anonymous). A client may instead be
// known by the Unix credentials of a caller on the proxy's Unix socket: a
// uid, or a systemd unit.
//
// # Limits
//
// Each is off at 0:
//   - rpm: requests per minute, a token bucket of rpm requests refilled at
//     rpm/60 a second (a burst of rpm, then the steady rate);
//   - tpm: tokens per minute, the same bucket of tokens, charged after the
//     fact with the response's usage (prompt + completion tokens): a request
//     is admitted while the balance is above zero, and its cost may take the
//     balance below it, which the refill then pays back;
//   - max_concurrent: requests in flight at once.
//
// A request over a limit is refused with 429 rate_limit_exceeded, Retry-After
// (whole seconds until the limit would admit it) and the headers OpenAI
// sends and its SDKs read (x-ratelimit-limit-requests, -remaining-requests,
// -reset-requests and the -tokens three).
//
// # Secrets
//
// A key is never logged, never put in an error and never stored: the
// Registry holds hashes, compares them in constant time, and forgets a
// removed or rotated key on the next Set, which the agent calls before it
// answers the change.
package clients
