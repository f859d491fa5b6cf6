package main

import (
	"context"
	"fmt"
	"net/http"
)

// fixedRequests sends n small chat completions for model to addr, one at a
// time over one keep-alive connection, and checks each answers 200. It is
// the fixed workload that bench/run.sh counts the instructions of (under
// valgrind's callgrind, whose count does not depend on what else the host
// is doing).
func fixedRequests(ctx context.Context, addr, model string, n int) error {
	c, err := dial(ctx, addr)
	if err != nil {
		return err
	}
	defer c.Close()
	req := buildRequest(addr, chatPath, smallBody(model))
	for i := range n {
		if err := ctx.Err(); err != nil {
			return err
		}
		status, err := c.do(req, nil)
		if err != nil {
			return fmt.Errorf("request %d: %w", i+1, err)
		}
		if status != http.StatusOK {
			return fmt.Errorf("request %d: status %d", i+1, status)
		}
	}
	return nil
}
