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
	// MaxParallel bounds Config.Parallel.
	MaxParallel = 4096
	// MaxCacheTokens bounds Config.CacheTokens.
	MaxCacheTokens = 1 << 30
	// MaxCacheBlock bounds Config.CacheBlock.
	MaxCacheBlock = 1 << 16
)

// The /metrics formats of Config.Metrics.
const (
	// MetricsNone serves no /metrics (404, as an unknown path).
	MetricsNone = "none"
	// MetricsLlamaCpp serves llama-server's names (llamacpp:...) and /slots.
	MetricsLlamaCpp = "llamacpp"
	// MetricsVLLM serves vLLM's names (vllm:...).
	MetricsVLLM = "vllm"
)

// defaultCacheBlock is CacheBlock's default. vLLM's blocks are 16 tokens;
// 64 keeps the index small for prompts of thousands of tokens.
const defaultCacheBlock = 64

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

	// The engine (see the package doc, "Engine mode") is on when Parallel
	// is above 0; PrefillPerToken, CacheTokens, CacheBlock and a Metrics
	// format other than none need it.

	// Parallel is the number of slots, as llama-server's --parallel: that
	// many generation requests run at once, the others wait in a FIFO
	// queue. 0 = no engine: any number at once, none waits.
	Parallel int
	// PrefillPerToken is what prefilling one prompt token that is not in
	// the prefix cache costs, before the first token; 0 = nothing.
	PrefillPerToken time.Duration
	// DecodePerToken is the time between generated tokens: the engine's
	// name for TokenDelay (set one of the two, or both to the same value).
	DecodePerToken time.Duration
	// CacheTokens is the prefix cache's capacity in tokens (LRU); 0 = no
	// cache, every prompt token is prefilled.
	CacheTokens int
	// CacheBlock is the prefix cache's granularity in tokens; 0 = 64.
	CacheBlock int
	// Metrics is the format of GET /metrics: MetricsLlamaCpp (with GET
	// /slots), MetricsVLLM or MetricsNone; "" = none.
	Metrics string
	// LoadTime is how long after New the server answers 503 "Loading
	// model" to everything but the model list, as llama-server does while
	// it loads a model; 0 = ready at once. It needs no engine.
	LoadTime time.Duration
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
		CacheBlock:   defaultCacheBlock,
		Metrics:      MetricsNone,
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
	return c.engineDefaults()
}

// engineDefaults validates and fills the engine's fields.
func (c Config) engineDefaults() (Config, error) {
	bad := func(format string, args ...any) (Config, error) {
		return c, fmt.Errorf("demomodel: config: "+format, args...)
	}
	if c.Parallel < 0 || c.Parallel > MaxParallel {
		return bad("Parallel must be in [0, %d], got %d", MaxParallel, c.Parallel)
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"PrefillPerToken", c.PrefillPerToken}, {"DecodePerToken", c.DecodePerToken}, {"LoadTime", c.LoadTime}} {
		if f.d < 0 {
			return bad("%s must not be negative, got %v", f.name, f.d)
		}
	}
	if c.DecodePerToken > 0 && c.TokenDelay > 0 && c.DecodePerToken != c.TokenDelay {
		return bad("DecodePerToken (%v) and TokenDelay (%v) are the same setting; give one", c.DecodePerToken, c.TokenDelay)
	}
	if c.CacheTokens < 0 || c.CacheTokens > MaxCacheTokens {
		return bad("CacheTokens must be in [0, %d], got %d", MaxCacheTokens, c.CacheTokens)
	}
	switch {
	case c.CacheBlock < 0 || c.CacheBlock > MaxCacheBlock:
		return bad("CacheBlock must be in [0, %d], got %d", MaxCacheBlock, c.CacheBlock)
	case c.CacheBlock == 0:
		c.CacheBlock = defaultCacheBlock
	}
	if c.CacheTokens > 0 && c.CacheTokens < c.CacheBlock {
		return bad("CacheTokens (%d) is smaller than one block (CacheBlock %d)", c.CacheTokens, c.CacheBlock)
	}
	switch c.Metrics {
	case "":
		c.Metrics = MetricsNone
	case MetricsNone, MetricsLlamaCpp, MetricsVLLM:
	default:
		return bad("Metrics %q is not %s, %s or %s", c.Metrics, MetricsLlamaCpp, MetricsVLLM, MetricsNone)
	}
	if c.Parallel == 0 {
		for _, f := range []struct {
			name string
			set  bool
		}{{"PrefillPerToken", c.PrefillPerToken > 0}, {"CacheTokens", c.CacheTokens > 0}, {"Metrics", c.Metrics != MetricsNone}} {
			if f.set {
				return bad("%s needs the engine: set Parallel (the number of slots) too", f.name)
			}
		}
	}
	return c, nil
}
