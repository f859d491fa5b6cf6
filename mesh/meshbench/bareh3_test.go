package meshbench

import (
	"context"
	"sync"
	"testing"
)

// The bare HTTP/3 exchange answers, concurrently too, and Close stops
// every goroutine (TestMain's goleak check).
func TestBareH3(t *testing.T) {
	h, err := NewBareH3()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	body := []byte(`{"model":"chat","messages":[{"role":"user","content":"hi"}]}`)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for range 4 {
				if err := h.Do(context.Background(), body); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Do: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := h.Do(ctx, body); err == nil {
		t.Error("Do with a cancelled context succeeded")
	}
	h.Close()
	h.Close()
}
