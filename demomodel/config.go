package demomodel

import (
	"fmt"
	"time"
	"unicode"

	"go.uber.org/zap"
)

// Limits on the knobs, so a typo cannot make the server allocate gigabytes
// per request.
const (
	// MaxTokens bounds Config.Tokens.
	MaxTokens = 1 << 16
	// MaxEmbeddingDim bounds Config.EmbeddingDim and a request's "dimensions".
	MaxEmbeddingDim = 1 << 16
	// MaxBodyBytes bounds a request body; larger bodies get 413.
	MaxBodyBytes = 8 << 20
)

// Config configures a demo model Server. The zero value of every field means
// its default.
type Config struct {
	// Model is the model id served; "" = "demo". Requests naming another
	// model get 404 model_not_found.
	Model string
	// Tokens is the number of tokens per completion; 0 = 16. A request's
	// max_tokens / max_completion_tokens can only lower it.
	Tokens int
	// TokenDelay is the delay between streamed tokens (and, for a
	// non-streaming request, Tokens-1 such delays before the answer);
	// 0 = none, the zero-delay benchmark mode.
	TokenDelay time.Duration
	// EmbeddingDim is the length of embedding vectors; 0 = 16. A request's
	// "dimensions" overrides it.
	EmbeddingDim int
	// Logger receives debug logs; nil = nop.
	Logger *zap.Logger
}

// DefaultConfig returns the configuration the zero Config stands for, with
// every default filled in.
func DefaultConfig() Config {
	return Config{
		Model:        "demo",
		Tokens:       16,
		EmbeddingDim: 16,
		Logger:       zap.NewNop(),
	}
}

// withDefaults validates c and fills zero fields with their defaults. Errors
// name the bad field.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	if c.Model == "" {
		c.Model = d.Model
	}
	for _, r := range c.Model {
		if unicode.IsControl(r) || unicode.IsSpace(r) {
			return c, fmt.Errorf("demomodel: config: Model %q contains whitespace or control characters", c.Model)
		}
	}
	switch {
	case c.Tokens < 0 || c.Tokens > MaxTokens:
		return c, fmt.Errorf("demomodel: config: Tokens must be in [0, %d], got %d", MaxTokens, c.Tokens)
	case c.Tokens == 0:
		c.Tokens = d.Tokens
	}
	if c.TokenDelay < 0 {
		return c, fmt.Errorf("demomodel: config: TokenDelay must not be negative, got %v", c.TokenDelay)
	}
	switch {
	case c.EmbeddingDim < 0 || c.EmbeddingDim > MaxEmbeddingDim:
		return c, fmt.Errorf("demomodel: config: EmbeddingDim must be in [0, %d], got %d", MaxEmbeddingDim, c.EmbeddingDim)
	case c.EmbeddingDim == 0:
		c.EmbeddingDim = d.EmbeddingDim
	}
	if c.Logger == nil {
		c.Logger = d.Logger
	}
	return c, nil
}
