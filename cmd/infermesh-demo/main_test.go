package main

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/goleak"

	"github.com/infermesh/infermesh/demomodel"
	"github.com/infermesh/infermesh/internal/testing/testproc"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func envFrom(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    options // only listen and demoModel are compared
		wantErr string
	}{
		{
			name: "defaults",
			want: options{listen: "127.0.0.1:8081"},
		},
		{
			name: "flags",
			args: []string{"-listen", "0.0.0.0:8080", "-model", "m", "-tokens", "3", "-token-delay", "5ms", "-embedding-dim", "8"},
			want: options{listen: "0.0.0.0:8080"},
		},
		{
			name: "environment",
			env:  map[string]string{"INFERMESH_DEMO_LISTEN": "0.0.0.0:9000", "INFERMESH_DEMO_TOKEN_DELAY": "2ms", "INFERMESH_DEMO_EMBEDDING_DIM": "4"},
			want: options{listen: "0.0.0.0:9000"},
		},
		{
			name: "flag beats environment",
			args: []string{"-listen", "127.0.0.2:1"},
			env:  map[string]string{"INFERMESH_DEMO_LISTEN": "0.0.0.0:9000"},
			want: options{listen: "127.0.0.2:1"},
		},
		{name: "bad env", env: map[string]string{"INFERMESH_DEMO_TOKENS": "many"}, wantErr: "INFERMESH_DEMO_TOKENS"},
		{name: "bad flag", args: []string{"-tokens", "x"}, wantErr: "-tokens"},
		{name: "extra args", args: []string{"serve"}, wantErr: "unexpected arguments"},
		{
			name: "engine",
			args: []string{"-parallel", "4", "-prefill-per-token", "200us", "-decode-per-token", "10ms", "-cache-tokens", "200000",
				"-cache-block", "32", "-load-time", "3s"},
			env:  map[string]string{"INFERMESH_DEMO_METRICS": "vllm"},
			want: options{listen: "127.0.0.1:8081"},
		},
	}
	// Fill in the expected model configs: the flags' defaults, then what
	// each case sets.
	for i := range tests {
		tests[i].want.demoModel = demomodel.Config{Model: "demo", Tokens: 16, EmbeddingDim: 16, CacheBlock: 64, Metrics: demomodel.MetricsNone}
	}
	tests[1].want.demoModel.Model, tests[1].want.demoModel.Tokens, tests[1].want.demoModel.TokenDelay, tests[1].want.demoModel.EmbeddingDim = "m", 3, 5*time.Millisecond, 8
	tests[2].want.demoModel.TokenDelay, tests[2].want.demoModel.EmbeddingDim = 2*time.Millisecond, 4
	e := &tests[len(tests)-1].want.demoModel
	e.Parallel, e.PrefillPerToken, e.DecodePerToken, e.CacheTokens, e.CacheBlock, e.Metrics, e.LoadTime = 4, 200*time.Microsecond, 10*time.Millisecond, 200000, 32, demomodel.MetricsVLLM, 3*time.Second
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			got, err := parseFlags(tt.args, envFrom(tt.env), &stderr)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error()+stderr.String(), tt.wantErr) {
					t.Fatalf("parseFlags error = %v (stderr %q), want one mentioning %q", err, stderr.String(), tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseFlags: %v", err)
			}
			if got.listen != tt.want.listen || got.demoModel != tt.want.demoModel {
				t.Errorf("parseFlags = listen %q model %+v; want %q %+v", got.listen, got.demoModel, tt.want.listen, tt.want.demoModel)
			}
		})
	}
	if _, err := parseFlags([]string{"-h"}, envFrom(nil), io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("parseFlags(-h) = %v, want flag.ErrHelp", err)
	}
}

func TestRunServesAndStops(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var logs testproc.SyncBuffer
	addr, errc := startRun(ctx, t, []string{"-listen", "127.0.0.1:0", "-model", "tiny", "-tokens", "3"}, envFrom(nil), &logs)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := openai.NewClient(
		option.WithBaseURL("http://"+addr.String()+"/v1/"),
		option.WithAPIKey("x"),
		option.WithHTTPClient(&http.Client{Transport: tr}),
		option.WithMaxRetries(0),
	)
	got, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "tiny",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
	})
	if err != nil {
		t.Fatalf("chat: %v", err)
	}
	if n := len(strings.Fields(got.Choices[0].Message.Content)); n != 3 || got.Model != "tiny" {
		t.Errorf("chat = %s, want 3 tokens from tiny", got.RawJSON())
	}

	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("run after cancel = %v, want nil (clean exit)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after cancel")
	}
	if !strings.Contains(logs.String(), `"msg":"stopped"`) {
		t.Errorf("logs lack the stop line: %s", logs.String())
	}
}

func TestRunBadConfig(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"negative tokens", []string{"-tokens", "-1"}, "Tokens"},
		{"bad listen", []string{"-listen", "not-an-address"}, "listen"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := run(t.Context(), tt.args, envFrom(nil), io.Discard, nil)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("run(%q) = %v, want an error mentioning %q", tt.args, err, tt.wantErr)
			}
		})
	}
}

// TestStaticBinary builds the command the way the container image does
// (CGO_ENABLED=0), checks the result is statically linked, runs it bound to
// 0.0.0.0 as inside a container, and stops it with SIGTERM.
func TestStaticBinary(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go tool not found: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "infermesh-demo")
	build := exec.CommandContext(t.Context(), goBin, "build", "-trimpath", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	f, err := elf.Open(bin)
	if err != nil {
		t.Fatalf("open ELF: %v", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("binary has program header %v; want a static binary", p.Type)
		}
	}
	f.Close()

	cmd := exec.Command(bin, "-listen", "0.0.0.0:0")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start: %v", err)
	}
	done := make(chan error, 1)
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
		close(lines)
		done <- cmd.Wait()
	}()
	exited := false
	defer func() {
		if !exited {
			_ = cmd.Process.Kill()
			<-done
		}
	}()

	var listen string
	timeout := time.After(10 * time.Second)
	for listen == "" {
		select {
		case line, ok := <-lines:
			if !ok {
				exited = true
				t.Fatalf("binary exited before serving: %v", <-done)
			}
			var entry struct {
				Msg    string `json:"msg"`
				Listen string `json:"listen"`
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "serving demo model" {
				listen = entry.Listen
			}
		case <-timeout:
			t.Fatal("binary did not log its listen address")
		}
	}
	_, port, err := net.SplitHostPort(listen)
	if err != nil {
		t.Fatalf("listen address %q: %v", listen, err)
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("http://127.0.0.1:" + port + "/health")
	if err != nil {
		t.Fatalf("GET /health: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != `{"status":"ok"}` {
		t.Errorf("/health = %d %s", resp.StatusCode, body)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
	select {
	case err := <-done:
		exited = true
		if err != nil {
			t.Errorf("exit after SIGTERM = %v, want status 0", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("binary did not exit after SIGTERM")
	}
}

// TestRunAPIKey: with -api-key (here from the environment) every path, the
// health path included, wants the key; a wrong or missing one gets 401.
func TestRunAPIKey(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	var logs testproc.SyncBuffer
	addr, errc := startRun(ctx, t, []string{"-listen", "127.0.0.1:0"}, envFrom(map[string]string{"INFERMESH_DEMO_API_KEY": "sk-demo"}), &logs)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	for _, tt := range []struct {
		path, auth string
		want       int
	}{
		{"/health", "", http.StatusUnauthorized},
		{"/health", "Bearer sk-other", http.StatusUnauthorized},
		{"/health", "Bearer sk-demo", http.StatusOK},
		{"/v1/models", "", http.StatusUnauthorized},
		{"/v1/models", "Bearer sk-demo", http.StatusOK},
	} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr.String()+tt.path, nil)
		if tt.auth != "" {
			req.Header.Set("Authorization", tt.auth)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tt.want {
			t.Errorf("GET %s with %q: %d %s, want %d", tt.path, tt.auth, resp.StatusCode, body, tt.want)
		}
		if tt.want == http.StatusUnauthorized && !strings.Contains(string(body), `"code":"invalid_api_key"`) {
			t.Errorf("401 body %s, want an OpenAI-shaped error", body)
		}
	}
	cancel()
	if err := <-errc; err != nil {
		t.Errorf("run after cancel = %v", err)
	}
}

// startRun runs run in a goroutine and returns the address it serves on
// and the channel its result arrives on.
func startRun(ctx context.Context, t *testing.T, args []string, getenv func(string) string, logs io.Writer) (net.Addr, <-chan error) {
	t.Helper()
	ready := make(chan net.Addr, 1)
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, args, getenv, logs, ready) }()
	select {
	case addr := <-ready:
		return addr, errc
	case err := <-errc:
		t.Fatalf("run exited early: %v", err)
		return nil, nil
	}
}
