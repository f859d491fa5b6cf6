package proxy

import (
	"bytes"
	"io"
	"math/rand/v2"
	"testing"
	"time"
)

func TestLastUsage(t *testing.T) {
	tests := []struct {
		name, in           string
		prompt, completion int64
		ok                 bool
	}{
		{"json body", `{"id":"1","choices":[],"usage":{"prompt_tokens":7,"total_tokens":23,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":2}}}`, 7, 16, true},
		{"sse final chunk", "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n", 5, 9, true},
		{"usage null at the end", "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\ndata: {\"usage\":null}\n\n", 5, 9, true},
		{"none", `{"choices":[{"message":{"content":"the \"usage\": {\"prompt_tokens\":3}"}}]}`, 0, 0, false},
		{"cut at the start", `prompt_tokens":5,"completion_tokens":9}}`, 0, 0, false},
		{"cut at the end", `{"usage":{"prompt_tokens":5,"completion_tokens":9`, 0, 0, false},
		{"not a count", `{"usage":{"prompt_tokens":"five"}}`, 0, 0, false},
		{"embeddings", `{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}`, 4, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, c, ok := lastUsage([]byte(tt.in))
			if p != tt.prompt || c != tt.completion || ok != tt.ok {
				t.Errorf("lastUsage = %d, %d, %v; want %d, %d, %v", p, c, ok, tt.prompt, tt.completion, tt.ok)
			}
		})
	}
}

// The meter's ring keeps what a plain buffer of everything written would
// end with: its last meterTail bytes, in order, over writes of every size
// around the ring's length and a Tail taken between writes.
func TestMeterTailIsTheLastBytes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	sizes := []int{0, 1, 7, 100, meterTail - 1, meterTail, meterTail + 1, 2*meterTail + 3}
	for round := range 200 {
		m := getMeter(io.Discard, round%2 == 0, time.Now())
		var all []byte
		for w := range 1 + rng.IntN(40) {
			n := sizes[rng.IntN(len(sizes))]
			if rng.IntN(2) == 0 {
				n = rng.IntN(600)
			}
			b := make([]byte, n)
			for i := range b {
				b[i] = byte(rng.IntN(256))
			}
			if _, err := m.Write(b); err != nil {
				t.Fatal(err)
			}
			all = append(all, b...)
			if w%7 == 3 || rng.IntN(10) == 0 {
				want := all[max(0, len(all)-meterTail):]
				if got := m.Tail(); !bytes.Equal(got, want) {
					t.Fatalf("round %d after %d bytes: Tail() = %d bytes, want the last %d", round, len(all), len(got), len(want))
				}
			}
		}
		want := all[max(0, len(all)-meterTail):]
		if got := m.Tail(); !bytes.Equal(got, want) {
			t.Fatalf("round %d, %d bytes: Tail() = %d bytes, want the last %d", round, len(all), len(got), len(want))
		}
		m.release()
	}
}
