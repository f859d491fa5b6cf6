package main

import (
	"context"
	"sync"
	"time"
)

// connPool keeps idle keep-alive connections to one address.
type connPool struct {
	addr string
	mu   sync.Mutex
	idle []*conn
}

func (rb *routingBench) pool(addr string) *connPool {
	if p, ok := rb.pools.Load(addr); ok {
		return p.(*connPool)
	}
	p, _ := rb.pools.LoadOrStore(addr, &connPool{addr: addr})
	return p.(*connPool)
}

func (p *connPool) get(ctx context.Context) (*conn, error) {
	p.mu.Lock()
	if n := len(p.idle); n > 0 {
		c := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return c, nil
	}
	p.mu.Unlock()
	return dial(ctx, p.addr)
}

func (p *connPool) put(c *conn) {
	p.mu.Lock()
	p.idle = append(p.idle, c)
	p.mu.Unlock()
}

func (rb *routingBench) closePools() {
	rb.pools.Range(func(_, v any) bool {
		p := v.(*connPool)
		p.mu.Lock()
		for _, c := range p.idle {
			c.Close()
		}
		p.idle = nil
		p.mu.Unlock()
		return true
	})
}

// queueSampler reads the engines' queues during a window.
type queueSampler struct {
	first, second, end []int
	done               chan struct{}
	wg                 sync.WaitGroup
}

func newQueueSampler(n int) *queueSampler {
	return &queueSampler{first: make([]int, n), second: make([]int, n), end: make([]int, n), done: make(chan struct{})}
}

func (q *queueSampler) start(ctx context.Context, ec *engineClient, addrs []string, start time.Time, d, every time.Duration) {
	if len(addrs) != len(q.first) {
		return
	}
	q.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-q.done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			el := time.Since(start)
			if el > d {
				continue // the window is over; end was read at its close
			}
			rs, err := ec.readAll(ctx, addrs)
			if err != nil {
				continue
			}
			for i, r := range rs {
				w := int(r.waiting)
				if el < d/2 {
					q.first[i] = max(q.first[i], w)
				} else {
					q.second[i] = max(q.second[i], w)
				}
				q.end[i] = w
			}
		}
	})
}

func (q *queueSampler) stop() {
	close(q.done)
	q.wg.Wait()
}
