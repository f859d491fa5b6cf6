package demomodel

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strconv"

	"github.com/infermesh/infermesh/internal/prompt"
)

// words is the vocabulary of the demo model. Every word is plain lowercase
// ASCII, so it can be appended into JSON strings without escaping (a test
// checks this).
var words = [...]string{
	"the", "mesh", "routes", "every", "request", "to", "a", "model",
	"on", "this", "host", "or", "an", "admitted", "peer", "over",
	"quic", "and", "streams", "tokens", "back", "without", "buffering", "while",
	"placement", "prefers", "local", "instances", "first", "then", "remote", "nodes",
	"signed", "adverts", "travel", "by", "gossip", "so", "each", "agent",
	"knows", "which", "roles", "its", "neighbours", "serve", "today", "quickly",
	"demo", "answers", "are", "deterministic", "for", "tests", "benchmarks", "alike",
	"latency", "matters", "more", "than", "words", "here", "friend", "indeed",
}

// wordsFollowing holds each word with the leading space it carries when it is
// not the first token of a completion.
var wordsFollowing = func() [len(words)]string {
	var out [len(words)]string
	for i, w := range words {
		out[i] = " " + w
	}
	return out
}()

// golden is the 64-bit golden-ratio increment of splitmix64.
const golden = 0x9E3779B97F4A7C15

// FNV-1a 64-bit parameters.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// token returns the text of token i of the completion seeded by seed.
func token(seed uint64, i int) string {
	w := prompt.Mix64(seed+uint64(i+1)*golden) % uint64(len(words))
	if i == 0 {
		return words[w]
	}
	return wordsFollowing[w]
}

// appendTokens appends the text of tokens [0, n) to b (no quoting needed).
func appendTokens(b []byte, seed uint64, n int) []byte {
	for i := 0; i < n; i++ {
		b = append(b, token(seed, i)...)
	}
	return b
}

// estimateTokens is the usual "four bytes per token" estimate, at least 1.
func estimateTokens(nbytes int) int {
	if n := (nbytes + 3) / 4; n > 0 {
		return n
	}
	return 1
}

// embedValue returns the i-th raw (unnormalized) component of the vector
// seeded by seed, uniform in [-1, 1).
func embedValue(seed uint64, i int) float64 {
	return float64(int64(prompt.Mix64(seed+uint64(i+1)*golden))) / (1 << 63)
}

// embed fills dst with the unit-norm vector seeded by seed. The components
// are generated twice (once for the norm, once for the values) so no scratch
// buffer is needed.
func embed(dst []float32, seed uint64) {
	var sum float64
	for i := range dst {
		v := embedValue(seed, i)
		sum += v * v
	}
	if sum == 0 { // not reachable in practice; keep the unit-norm promise anyway
		clear(dst)
		dst[0] = 1
		return
	}
	inv := 1 / math.Sqrt(sum)
	for i := range dst {
		dst[i] = float32(embedValue(seed, i) * inv)
	}
}

// appendEmbeddingFloats appends v as a JSON array of numbers. Values are
// formatted at float32 precision so the float and base64 encodings carry the
// same numbers.
func appendEmbeddingFloats(b []byte, v []float32) []byte {
	b = append(b, '[')
	for i, f := range v {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendFloat(b, float64(f), 'g', -1, 32)
	}
	return append(b, ']')
}

// appendEmbeddingBase64 appends v as a JSON string holding the base64 of its
// little-endian float32 bytes, the encoding OpenAI uses for
// encoding_format "base64".
func appendEmbeddingBase64(b, scratch []byte, v []float32) ([]byte, []byte) {
	scratch = scratch[:0]
	for _, f := range v {
		scratch = binary.LittleEndian.AppendUint32(scratch, math.Float32bits(f))
	}
	b = append(b, '"')
	b = base64.StdEncoding.AppendEncode(b, scratch)
	return append(b, '"'), scratch
}
