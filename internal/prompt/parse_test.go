package prompt

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// parseBoth is Parse, checked against ParseStd.
func parseBoth(t *testing.T, body string, chat bool, block int) Info {
	t.Helper()
	if !json.Valid([]byte(body)) {
		t.Fatalf("test body is not valid JSON: %s", body)
	}
	got := Parse([]byte(body), chat, block, nil)
	if std := ParseStd([]byte(body), chat, block, nil); !reflect.DeepEqual(got, std) {
		t.Fatalf("Parse(%s) = %+v, ParseStd %+v", body, got, std)
	}
	return got
}

func chatBody(members string, msgs ...string) string {
	if members != "" {
		members += ","
	}
	return `{"model":"m",` + members + `"messages":` + messages(msgs...) + `,"stream":true}`
}

var (
	system = msg("system", strings.Repeat("You are a helpful assistant. ", 10)) // 290 bytes: 73 tokens
	hello  = msg("user", "Hello!")
)

func TestParse(t *testing.T) {
	for _, tt := range []struct {
		name   string
		body   string
		chat   bool
		source KeySource
		tokens int // with blocks of 4 tokens
	}{
		{"prompt_cache_key first", chatBody(`"user":"u","prompt_cache_key":"k"`, system, hello), true, KeyCacheKey, 75},
		{"empty prompt_cache_key: user", chatBody(`"prompt_cache_key":"","user":"u"`, system, hello), true, KeyUser, 75},
		{"prompt_cache_key not a string: user", chatBody(`"prompt_cache_key":7,"user":"u"`, system, hello), true, KeyUser, 75},
		{"null user: prefix", chatBody(`"user":null`, system, hello), true, KeyPrefix, 75},
		{"empty user: prefix", chatBody(`"user":""`, system, hello), true, KeyPrefix, 75},
		{"the last of duplicates counts", chatBody(`"user":"u","user":7`, system, hello), true, KeyPrefix, 75},
		{"escaped member names", `{"m\u0065ssages":` + messages(hello) + `,"\u0075ser":"u"}`, true, KeyUser, 2},
		{"names are case-sensitive", `{"Messages":` + messages(hello) + `,"User":"u"}`, true, KeyNone, 0},
		{"short prompt: none", chatBody("", hello), true, KeyNone, 2},
		{"short prompt with tools: prefix", chatBody(`"tools":[{"type":"function","function":{"name":"f"}}]`, hello), true, KeyPrefix, 2},
		{"null tools: none", chatBody(`"tools":null`, hello), true, KeyNone, 2},
		{"empty tools: none", chatBody(`"tools":[ ]`, hello), true, KeyNone, 2},
		{"no messages", `{"model":"m"}`, true, KeyNone, 0},
		{"null messages", `{"messages":null}`, true, KeyNone, 0},
		{"no messages, a user", `{"model":"m","user":"u"}`, true, KeyUser, 0},
		{"empty messages", `{"messages":[]}`, true, KeyNone, 0},
		{"one long message", chatBody("", system), true, KeyPrefix, 73},
		{"text completion", `{"prompt":"` + strings.Repeat("x", 64) + `"}`, false, KeyPrefix, 16},
		{"short text completion", `{"prompt":"abc"}`, false, KeyNone, 1},
		{"text completion: messages and tools do not count", `{"prompt":"abc","messages":` + messages(system) + `,"tools":[1]}`, false, KeyNone, 1},
		{"text completion, prompt_cache_key", `{"prompt":"abc","prompt_cache_key":"k"}`, false, KeyCacheKey, 1},
		{"not an object", `[1]`, true, KeyNone, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := parseBoth(t, tt.body, tt.chat, 4)
			if got.Tokens.N != tt.tokens || len(got.Tokens.Blocks) != tt.tokens/4 {
				t.Errorf("tokens, blocks = %d, %d; want %d, %d", got.Tokens.N, len(got.Tokens.Blocks), tt.tokens, tt.tokens/4)
			}
			if got.KeySource != tt.source || (got.Key == 0) != (tt.source == KeyNone) {
				t.Errorf("key = %#x from %v, want one from %v", got.Key, got.KeySource, tt.source)
			}
		})
	}
}

// Parse's Tokens are Tokenize's of the prompt member.
func TestParseTokens(t *testing.T) {
	raw := messages(system, msg("user", `caf\u00e9 \"quoted\"`), `{"role":"assistant","content":[{"type":"text","text":"ok"}]}`)
	got := parseBoth(t, `{"tools":[],"messages":`+raw+`}`, true, 4)
	if want := Tokenize([]byte(raw), true, 4, nil); !reflect.DeepEqual(got.Tokens, want) {
		t.Errorf("Tokens = %+v, want %+v", got.Tokens, want)
	}
}

func TestParseKeys(t *testing.T) {
	key := func(body string, chat bool) uint64 { return parseBoth(t, body, chat, 4).Key }
	same := func(what string, a, b uint64) {
		t.Helper()
		if a != b {
			t.Errorf("%s: keys %#x and %#x, want equal", what, a, b)
		}
	}
	differ := func(what string, a, b uint64) {
		t.Helper()
		if a == b {
			t.Errorf("%s: keys both %#x, want different", what, a)
		}
	}
	base := key(chatBody("", system, hello), true)
	same("another last message", base, key(chatBody("", system, msg("user", strings.Repeat("other ", 50))), true))
	same("other members", base, key(`{"temperature":0.5,"messages":`+messages(system, hello)+`}`, true))
	differ("another system prompt", base, key(chatBody("", msg("system", strings.Repeat("You are a terse assistant.   ", 10)), hello), true))
	differ("another system role", base, key(chatBody("", strings.Replace(system, "system", "developer", 1), hello), true))
	const tools = `[{"type":"function","function":{"name":"f"}}]`
	withTools := key(chatBody(`"tools":`+tools, system, hello), true)
	differ("tools", base, withTools)
	differ("other tools", withTools, key(chatBody(`"tools":[{"type":"function","function":{"name":"g"}}]`, system, hello), true))
	same("tools are hashed as they appear", withTools, key(`{"tools":`+tools+`,"messages":`+messages(system, msg("user", "Bye."))+`}`, true))

	// The prefix is the earlier turns, not only the system prompt.
	turn := messages(system, hello, msg("assistant", strings.Repeat("Hi there. ", 4)))
	two := key(`{"messages":`+turn[:len(turn)-1]+`,`+msg("user", "And then?")+`]}`, true)
	differ("earlier turns", base, two)
	same("earlier turns, another last message", two, key(`{"messages":`+turn[:len(turn)-1]+`,`+msg("user", "Why?")+`]}`, true))

	// No full block before the last message: the first full block.
	long := func(s string) uint64 { return key(chatBody("", msg("user", s)), true) }
	x := strings.Repeat("x", 16)
	same("first block of the last message", long(x+"a"), long(x+"b"))
	differ("first block of the last message differs", long(x), long("y"+x[1:]))

	// At most 32 blocks: 64 tokens of 4 bytes make 16 blocks of 4 tokens.
	s := strings.Repeat("s", 40*16)
	capped := key(chatBody("", msg("system", s), hello), true)
	same("beyond 32 blocks", capped, key(chatBody("", msg("system", s[:33*16]+"t"+s[33*16+1:]), hello), true))
	differ("within 32 blocks", capped, key(chatBody("", msg("system", s[:31*16]+"t"+s[31*16+1:]), hello), true))

	text := func(s string) uint64 { return key(`{"prompt":"`+s+`"}`, false) }
	same("text, beyond 32 blocks", text(s), text(s[:33*16]+"t"))
	differ("text, within 32 blocks", text(s), text(s[:31*16]+"t"))
	differ("text, last full block", text(x+x), text(x+"t"+x[1:]))
	same("text, after the last full block", text(x+x+"a"), text(x+x+"b"))

	differ("user and prompt_cache_key", key(`{"user":"abc"}`, true), key(`{"prompt_cache_key":"abc"}`, true))
	same("prompt_cache_key unescaped", key(`{"prompt_cache_key":"abc"}`, true), key(`{"prompt_cache_key":"a\u0062c"}`, true))
	same("user unescaped", key(`{"user":"é\n"}`, true), key(`{"user":"\u00e9\u000a"}`, true))
	differ("prompt_cache_key", key(`{"prompt_cache_key":"abc"}`, true), key(`{"prompt_cache_key":"abd"}`, true))
	same("prompt_cache_key, not the prompt", key(chatBody(`"prompt_cache_key":"k"`, system, hello), true), key(`{"prompt_cache_key":"k"}`, true))
}

// The keys' hashing does not change unnoticed.
func TestParseKnownKeys(t *testing.T) {
	for _, tt := range []struct {
		body   string
		chat   bool
		want   uint64
		source KeySource
	}{
		{`{"prompt_cache_key":"conversation-42"}`, true, 0xa65e72b6c5f39624, KeyCacheKey},
		{`{"user":"user-7"}`, false, 0xddadf63bedc4fd9c, KeyUser},
		{chatBody("", system, hello), true, 0xe211cd7d53735256, KeyPrefix},
		{chatBody(`"tools":[{"type":"function"}]`, hello), true, 0x2c96b35e6fc7dce, KeyPrefix},
		{`{"prompt":"The quick brown fox jumps over the lazy dog"}`, false, 0x9d4987be0de8c215, KeyPrefix},
	} {
		if got := parseBoth(t, tt.body, tt.chat, 4); got.Key != tt.want || got.KeySource != tt.source {
			t.Errorf("Parse(%s) key = %#x from %v, want %#x from %v", tt.body, got.Key, got.KeySource, tt.want, tt.source)
		}
	}
}

func TestKeySourceString(t *testing.T) {
	for k, want := range map[KeySource]string{
		KeyNone: "none", KeyCacheKey: "prompt_cache_key", KeyUser: "user", KeyPrefix: "prefix", 9: "KeySource(9)",
	} {
		if got := k.String(); got != want {
			t.Errorf("KeySource(%d).String() = %q, want %q", uint8(k), got, want)
		}
	}
}

// benchBody is a chat body with a 2,000-token (8,000-byte) system prompt
// and a 100-token user message.
func benchBody(tb testing.TB) []byte {
	var sys strings.Builder
	for sys.Len() < 8000 {
		sys.WriteString("You are a \"helpful\" assistant; answer briefly.\n")
	}
	body, err := json.Marshal(map[string]any{
		"model": "demo",
		"messages": []map[string]any{
			{"role": "system", "content": sys.String()[:8000]},
			{"role": "user", "content": strings.Repeat("What is up? ", 34)[:400]},
		},
		"temperature": 0.7,
		"stream":      true,
	})
	if err != nil {
		tb.Fatal(err)
	}
	return body
}

func TestParseAllocs(t *testing.T) {
	body := benchBody(t)
	blocks := make([]uint64, 0, 64)
	var info Info
	allocs := testing.AllocsPerRun(100, func() { info = Parse(body, true, 64, blocks) })
	if info.Tokens.N != 2100 || len(info.Tokens.Blocks) != 32 || info.KeySource != KeyPrefix {
		t.Fatalf("Parse = %d tokens, %d blocks, key from %v; want 2100, 32, prefix", info.Tokens.N, len(info.Tokens.Blocks), info.KeySource)
	}
	if allocs != 0 {
		t.Errorf("Parse allocates %v times, want 0", allocs)
	}
}

func BenchmarkParse(b *testing.B) {
	body := benchBody(b)
	blocks := make([]uint64, 0, 64)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		Parse(body, true, 64, blocks)
	}
}

func BenchmarkParseStd(b *testing.B) {
	body := benchBody(b)
	blocks := make([]uint64, 0, 64)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		ParseStd(body, true, 64, blocks)
	}
}
