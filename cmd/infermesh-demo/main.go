// Command infermesh-demo serves infermesh's built-in demo model: a small
// OpenAI-compatible inference server with deterministic output, used for
// development, tests, benchmarks and as the container image in provisioning
// tests. It is built static (CGO_ENABLED=0) so it runs in a FROM scratch
// image.
//
// Every flag can also be set through the environment: -listen through
// INFERMESH_DEMO_LISTEN, -model through INFERMESH_DEMO_MODEL, and so on
// (upper case, dashes become underscores). Flags win over the environment.
package main

import (
	"context"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/infermesh/infermesh/demomodel"
)

// shutdownGrace is how long in-flight requests (streams with a token delay)
// get to finish after a signal before connections are closed.
const shutdownGrace = 5 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stderr, nil); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "infermesh-demo:", err)
		os.Exit(1)
	}
}

// options are the parsed command line.
type options struct {
	listen    string
	apiKey    string
	logLevel  zapcore.Level
	demoModel demomodel.Config
}

// parseFlags parses args, taking defaults from the environment through
// getenv.
func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("infermesh-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8081", "address to listen on (host:port; 0.0.0.0:8080 inside a container)")
	fs.StringVar(&o.apiKey, "api-key", "", "require `Authorization: Bearer KEY` on every path, /health included (as LiteLLM's master key does); empty: none")
	fs.StringVar(&o.demoModel.Model, "model", "demo", "model id served")
	fs.IntVar(&o.demoModel.Tokens, "tokens", 16, "tokens per completion")
	fs.DurationVar(&o.demoModel.TokenDelay, "token-delay", 0, "delay between streamed tokens (0 = answer at once)")
	fs.IntVar(&o.demoModel.EmbeddingDim, "embedding-dim", 16, "embedding vector length")
	// Engine mode (the demomodel package doc): on with -parallel.
	fs.IntVar(&o.demoModel.Parallel, "parallel", 0, "engine mode: slots (requests at once); requests beyond them wait, FIFO (0 = no engine: any number at once)")
	fs.DurationVar(&o.demoModel.PrefillPerToken, "prefill-per-token", 0, "engine: prefill cost per prompt token not in the prefix cache")
	fs.DurationVar(&o.demoModel.DecodePerToken, "decode-per-token", 0, "cost per generated token after the first (the same setting as -token-delay)")
	fs.IntVar(&o.demoModel.CacheTokens, "cache-tokens", 0, "engine: prefix cache capacity in tokens, LRU (0 = no cache)")
	fs.IntVar(&o.demoModel.CacheBlock, "cache-block", 64, "engine: prefix cache granularity in tokens")
	fs.StringVar(&o.demoModel.Metrics, "metrics", demomodel.MetricsNone, "engine: /metrics in llama.cpp's format (llamacpp, with /slots), vLLM's (vllm), or none")
	fs.DurationVar(&o.demoModel.LoadTime, "load-time", 0, "/health (and all but /v1/models) answers 503 \"Loading model\" this long after start")
	o.logLevel = zapcore.InfoLevel
	fs.TextVar(&o.logLevel, "log-level", zapcore.InfoLevel, "log level: debug, info, warn, error")

	// Environment first, so flags given on the command line override it.
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		name := "INFERMESH_DEMO_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(name); v != "" && envErr == nil {
			if err := f.Value.Set(v); err != nil {
				envErr = fmt.Errorf("%s=%q: %w", name, v, err)
			}
		}
	})
	if envErr != nil {
		return o, envErr
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return o, nil
}

// run serves until ctx ends, then shuts down gracefully; a canceled ctx is a
// clean exit (nil). Logs (JSON) and flag errors go to stderr. If ready is not
// nil it receives the bound address once the server accepts connections.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer, ready chan<- net.Addr) error {
	o, err := parseFlags(args, getenv, stderr)
	if err != nil {
		return err
	}
	log := zap.New(zapcore.NewCore(
		zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()),
		zapcore.Lock(zapcore.AddSync(stderr)),
		o.logLevel,
	))
	defer func() { _ = log.Sync() }()

	o.demoModel.Logger = log.Named("demomodel")
	srv, err := demomodel.New(o.demoModel)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	cfg := srv.Config()
	log.Info("serving demo model",
		zap.String("listen", ln.Addr().String()),
		zap.String("model", cfg.Model),
		zap.Int("tokens", cfg.Tokens),
		zap.Duration("token_delay", cfg.TokenDelay),
		zap.Int("embedding_dim", cfg.EmbeddingDim),
		zap.Int("parallel", cfg.Parallel),
		zap.Duration("prefill_per_token", cfg.PrefillPerToken),
		zap.Duration("decode_per_token", cfg.DecodePerToken),
		zap.Int("cache_tokens", cfg.CacheTokens),
		zap.Int("cache_block", cfg.CacheBlock),
		zap.String("metrics", cfg.Metrics),
		zap.Duration("load_time", cfg.LoadTime))

	var h http.Handler = srv
	if o.apiKey != "" {
		h = requireKey(o.apiKey, srv)
	}
	hs := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	if ready != nil {
		ready <- ln.Addr()
	}

	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		log.Warn("graceful shutdown timed out; closing connections", zap.Error(err))
		_ = hs.Close()
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	st := srv.Stats()
	log.Info("stopped",
		zap.Uint64("chat_completions", st.ChatCompletions),
		zap.Uint64("completions", st.Completions),
		zap.Uint64("embeddings", st.Embeddings),
		zap.Uint64("canceled", st.Canceled))
	return nil
}

// requireKey answers 401, OpenAI-shaped, to a request without the key.
func requireKey(key string, next http.Handler) http.Handler {
	want := []byte("Bearer " + key)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"error":{"message":"invalid or missing API key","type":"invalid_request_error","code":"invalid_api_key"}}`)
			return
		}
		next.ServeHTTP(w, r)
	})
}
