package meshsim

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"
)

func TestTmpMeasure(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SIMN"))
	every, _ := time.ParseDuration(os.Getenv("SIMLOAD"))
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	r, err := Run(ctx, Options{N: n, Latency: time.Millisecond, Window: 30 * time.Second, TimeScale: TimeScaleFor(n), LoadEvery: every})
	t.Logf("%v err=%v", r, err)
}
