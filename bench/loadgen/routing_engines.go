package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// The routing benchmark reads the engines' own counters: the engines are
// the demo model in engine mode speaking vLLM's metrics, the format whose
// counters hold what the figures need (llama.cpp's have no request count
// and no cached tokens).

// engineReading is one scrape of an engine's /metrics.
type engineReading struct {
	queries  float64 // prompt tokens looked up in the prefix cache
	hits     float64 // of which were found
	requests float64 // finished, for any reason
	running  float64
	waiting  float64
}

// engineClient talks to the engines' metrics and control endpoints (not
// the measured path: net/http's client is fine here).
type engineClient struct{ c *http.Client }

func newEngineClient() *engineClient {
	return &engineClient{c: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 4}}}
}

func (ec *engineClient) close() { ec.c.CloseIdleConnections() }

// read scrapes addr's /metrics.
func (ec *engineClient) read(ctx context.Context, addr string) (engineReading, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return engineReading{}, err
	}
	resp, err := ec.c.Do(req)
	if err != nil {
		return engineReading{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return engineReading{}, fmt.Errorf("%s/metrics: status %d (is it an engine with -metrics vllm?)", addr, resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return engineReading{}, fmt.Errorf("%s/metrics: %w", addr, err)
	}
	var r engineReading
	for name, dst := range map[string]*float64{
		"vllm:prefix_cache_queries_total": &r.queries,
		"vllm:prefix_cache_hits_total":    &r.hits,
		"vllm:request_success_total":      &r.requests,
		"vllm:num_requests_running":       &r.running,
		"vllm:num_requests_waiting":       &r.waiting,
	} {
		f := fams[name]
		if f == nil {
			return engineReading{}, fmt.Errorf("%s/metrics: no %s", addr, name)
		}
		*dst = familySum(f)
	}
	return r, nil
}

// familySum adds up a counter's or a gauge's series.
func familySum(f *dto.MetricFamily) float64 {
	var sum float64
	for _, m := range f.GetMetric() {
		switch f.GetType() {
		case dto.MetricType_COUNTER:
			sum += m.GetCounter().GetValue()
		case dto.MetricType_GAUGE:
			sum += m.GetGauge().GetValue()
		}
	}
	return sum
}

// readAll scrapes every engine.
func (ec *engineClient) readAll(ctx context.Context, addrs []string) ([]engineReading, error) {
	out := make([]engineReading, len(addrs))
	for i, a := range addrs {
		r, err := ec.read(ctx, a)
		if err != nil {
			return nil, err
		}
		out[i] = r
	}
	return out, nil
}

// resetCaches empties every engine's prefix cache.
func (ec *engineClient) resetCaches(ctx context.Context, addrs []string) error {
	for _, a := range addrs {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+a+"/reset_prefix_cache", nil)
		if err != nil {
			return err
		}
		resp, err := ec.c.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s/reset_prefix_cache: status %d", a, resp.StatusCode)
		}
	}
	return nil
}

// waitIdle waits until no engine runs or queues a request (the requests
// of the last run have all been counted), for at most d.
func (ec *engineClient) waitIdle(ctx context.Context, addrs []string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		rs, err := ec.readAll(ctx, addrs)
		if err != nil {
			return err
		}
		busy := 0.0
		for _, r := range rs {
			busy += r.running + r.waiting
		}
		if busy == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("engines still hold %g requests after %v", busy, d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
