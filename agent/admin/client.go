package admin

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"syscall"
	"time"
)

// DefaultWait is how long the client keeps trying to connect while the
// agent starts.
const DefaultWait = 2 * time.Second

// Client talks to the admin API over the socket. It is safe for concurrent
// use.
type Client struct {
	path string
	wait time.Duration
	hc   *http.Client
}

// ClientOptions tune NewClient. Zero values mean the defaults.
type ClientOptions struct {
	// Wait bounds the connect retries while the socket is missing or
	// refuses connections (the agent is starting). Default DefaultWait;
	// negative: one attempt.
	Wait time.Duration
}

// NewClient returns a client of the socket at path.
func NewClient(path string, opts ClientOptions) *Client {
	if opts.Wait == 0 {
		opts.Wait = DefaultWait
	}
	c := &Client{path: path, wait: opts.Wait}
	c.hc = &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         c.dial,
		MaxIdleConnsPerHost: 2,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}}
	return c
}

// Path is the socket path.
func (c *Client) Path() string { return c.path }

// Close releases idle connections.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// dial connects to the socket, retrying while the agent is starting (no
// socket yet, or nobody accepting on it).
func (c *Client) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	deadline := time.Now().Add(max(c.wait, 0))
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", c.path)
		if err == nil {
			return conn, nil
		}
		if errors.Is(err, fs.ErrPermission) {
			// The kernel refused: the agent may well be running.
			return nil, refused(c.path, err)
		}
		retry := errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EAGAIN)
		if !retry || time.Now().After(deadline) {
			return nil, unreachable(c.path, err)
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	resp, err := c.open(ctx, method, path, in)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("admin %s %s: reading the answer: %w", method, path, err)
	}
	return nil
}

// open sends a request (in as its JSON body, when not nil) and returns the
// response once its status says it succeeded; the caller closes its body.
func (c *Client) open(ctx context.Context, method, path string, in any) (*http.Response, error) {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+Host+path, body)
	if err != nil {
		return nil, err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			return nil, ue.Err
		}
		return nil, err
	}
	if err := checkStatus(resp); err != nil {
		resp.Body.Close()
		return nil, err
	}
	return resp, nil
}

// readLines decodes every line of a newline-delimited JSON stream into a
// T and calls fn with it, until the stream ends (nil), a line does not
// decode, or fn returns an error or done.
func readLines[T any](r io.Reader, maxLine int, fn func(T) (done bool, err error)) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxLine)
	for sc.Scan() {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			return err
		}
		if done, err := fn(v); done || err != nil {
			return err
		}
	}
	return sc.Err()
}

func checkStatus(resp *http.Response) error {
	if resp.StatusCode/100 == 2 {
		return nil
	}
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	var eb errorBody
	if json.Unmarshal(raw, &eb) != nil || eb.Error.Message == "" {
		eb.Error = APIError{Code: codeInternal, Message: fmt.Sprintf("admin API: %s: %s", resp.Status, bytes.TrimSpace(raw))}
	}
	eb.Error.Status = resp.StatusCode
	return &eb.Error
}

func get[T any](ctx context.Context, c *Client, path string) (T, error) {
	var v T
	err := c.do(ctx, http.MethodGet, path, nil, &v)
	return v, err
}

func post[T any](ctx context.Context, c *Client, path string, in any) (T, error) {
	var v T
	err := c.do(ctx, http.MethodPost, path, in, &v)
	return v, err
}

// Status is GET /v0/status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	return get[Status](ctx, c, "/v0/status")
}

// Peers is GET /v0/peers.
func (c *Client) Peers(ctx context.Context) ([]Peer, error) {
	return get[[]Peer](ctx, c, "/v0/peers")
}

// Roles is GET /v0/roles.
func (c *Client) Roles(ctx context.Context) ([]Role, error) {
	return get[[]Role](ctx, c, "/v0/roles")
}

// Route is GET /v0/route/{role}.
func (c *Client) Route(ctx context.Context, role string) (Route, error) {
	return get[Route](ctx, c, "/v0/route/"+url.PathEscape(role))
}

// Policy is GET /v0/policy.
func (c *Client) Policy(ctx context.Context) ([]Override, error) {
	return get[[]Override](ctx, c, "/v0/policy")
}

// SetPolicy is POST /v0/policy.
func (c *Client) SetPolicy(ctx context.Context, pc PolicyChange) (PolicyResult, error) {
	return post[PolicyResult](ctx, c, "/v0/policy", pc)
}

// ResetPolicy is POST /v0/policy/reset.
func (c *Client) ResetPolicy(ctx context.Context, f PolicyFilter) (ResetResult, error) {
	return post[ResetResult](ctx, c, "/v0/policy/reset", f)
}

// Keyring is GET /v0/keyring: the keys by fingerprint (GossipKey.Key is
// empty).
func (c *Client) Keyring(ctx context.Context) (Keyring, error) {
	return get[Keyring](ctx, c, "/v0/keyring")
}

// KeyringSecrets is GET /v0/keyring?secrets=true: the keys themselves as
// well, for callers that may change things (others get ErrForbidden).
func (c *Client) KeyringSecrets(ctx context.Context) (Keyring, error) {
	return get[Keyring](ctx, c, "/v0/keyring?secrets=true")
}

// ChangeKeyring is POST /v0/keyring/{op}.
func (c *Client) ChangeKeyring(ctx context.Context, kc KeyringChange) (Keyring, error) {
	return post[Keyring](ctx, c, "/v0/keyring/"+url.PathEscape(kc.Op), kc)
}

// Reload is POST /v0/reload.
func (c *Client) Reload(ctx context.Context) (ReloadResult, error) {
	return post[ReloadResult](ctx, c, "/v0/reload", struct{}{})
}

// Instances is GET /v0/instances.
func (c *Client) Instances(ctx context.Context) ([]Instance, error) {
	return get[[]Instance](ctx, c, "/v0/instances")
}

// InstanceLogs is GET /v0/instances/{role}/logs?n=N.
func (c *Client) InstanceLogs(ctx context.Context, role string, n int) ([]LogLine, error) {
	return get[[]LogLine](ctx, c, "/v0/instances/"+url.PathEscape(role)+"/logs?n="+strconv.Itoa(n))
}

// ErrLogEnded is returned by FollowInstanceLogs when the role's instance
// went away; the error says why.
var ErrLogEnded = errors.New("the log ended")

// FollowInstanceLogs is GET /v0/instances/{role}/logs?follow=true: fn sees
// up to n recent lines (n < 1: all kept), then every new line, until ctx
// ends (nil), fn returns an error (that error), the role's instance goes
// away (an error wrapping ErrLogEnded) or the agent ends the stream
// (ErrStreamEnded: it is stopping).
func (c *Client) FollowInstanceLogs(ctx context.Context, role string, n int, fn func(LogLine) error) error {
	resp, err := c.open(ctx, http.MethodGet, "/v0/instances/"+url.PathEscape(role)+"/logs?follow=true&n="+strconv.Itoa(n), nil)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer resp.Body.Close()
	var end, fnErr error
	err = readLines(resp.Body, 1<<20, func(l LogLine) (bool, error) {
		if l.Stream == LogStreamEnd {
			end = fmt.Errorf("%w: %s", ErrLogEnded, l.Line)
			return true, nil
		}
		fnErr = fn(l)
		return false, fnErr
	})
	switch {
	case fnErr != nil:
		return fnErr
	case end != nil:
		return end
	case ctx.Err() != nil:
		return nil
	case err != nil:
		return fmt.Errorf("log stream: %w", err)
	}
	return ErrStreamEnded
}

// StopInstance is POST /v0/instances/{role}/stop.
func (c *Client) StopInstance(ctx context.Context, role string) (Instance, error) {
	return post[Instance](ctx, c, "/v0/instances/"+url.PathEscape(role)+"/stop", struct{}{})
}

// RetryInstance is POST /v0/instances/{role}/retry.
func (c *Client) RetryInstance(ctx context.Context, role string) (Instance, error) {
	return post[Instance](ctx, c, "/v0/instances/"+url.PathEscape(role)+"/retry", struct{}{})
}

// Metrics is GET /metrics, in the Prometheus text format.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	resp, err := c.open(ctx, http.MethodGet, "/metrics", nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// ErrStreamEnded is returned by Events and FollowInstanceLogs when the
// agent ends the stream (it is stopping).
var ErrStreamEnded = errors.New("stream ended by the agent (it stopped?)")

// Events follows GET /v0/events, calling fn for each event until ctx ends
// (nil), fn returns an error (that error), or the agent ends the stream
// (ErrStreamEnded). Without o.Follow the stream ends after the history and
// Events returns nil.
func (c *Client) Events(ctx context.Context, o EventsOptions, fn func(Event) error) error {
	path := "/v0/events?follow=" + strconv.FormatBool(o.Follow)
	if o.Last > 0 {
		path += "&last=" + strconv.Itoa(o.Last)
	}
	err := c.events(ctx, path, fn)
	if !o.Follow && errors.Is(err, ErrStreamEnded) {
		return nil
	}
	return err
}

func (c *Client) events(ctx context.Context, path string, fn func(Event) error) error {
	resp, err := c.open(ctx, http.MethodGet, path, nil)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer resp.Body.Close()
	var fnErr error
	err = readLines(resp.Body, 1<<20, func(e Event) (bool, error) {
		fnErr = fn(e)
		return false, fnErr
	})
	switch {
	case fnErr != nil:
		return fnErr
	case ctx.Err() != nil:
		return nil
	case err != nil:
		return fmt.Errorf("event stream: %w", err)
	}
	return ErrStreamEnded
}
