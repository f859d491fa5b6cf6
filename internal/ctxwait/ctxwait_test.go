package ctxwait

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestSleep(t *testing.T) {
	defer goleak.VerifyNone(t)
	done, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name string
		ctx  context.Context
		d    time.Duration
		want bool
	}{
		{"elapses", context.Background(), time.Millisecond, true},
		{"zero elapses at once", context.Background(), 0, true},
		{"negative elapses at once", context.Background(), -time.Second, true},
		{"done context wins over a long wait", done, time.Hour, false},
		{"done context wins over zero", done, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Sleep(tt.ctx, tt.d); got != tt.want {
				t.Errorf("Sleep(%v) = %v, want %v", tt.d, got, tt.want)
			}
		})
	}
}

func TestSleepReturnsWhenCancelledMidway(t *testing.T) {
	defer goleak.VerifyNone(t)
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan bool, 1)
	go func() { got <- Sleep(ctx, time.Hour) }()
	cancel()
	select {
	case ok := <-got:
		if ok {
			t.Errorf("Sleep after cancel = true, want false")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Sleep(1h) did not return after its context was cancelled")
	}
}
