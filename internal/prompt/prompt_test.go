package prompt

import (
	"reflect"
	"strings"
	"testing"
)

func msg(role, content string) string { return `{"role":"` + role + `","content":"` + content + `"}` }

func messages(msgs ...string) string { return "[" + strings.Join(msgs, ",") + "]" }

// The token rule, exactly.
func TestTokenizeCounts(t *testing.T) {
	for _, tt := range []struct {
		name   string
		raw    string
		chat   bool
		tokens int
	}{
		{"empty content is one token", messages(msg("user", "")), true, 1},
		{"1 byte", messages(msg("user", "a")), true, 1},
		{"4 bytes", messages(msg("user", "abcd")), true, 1},
		{"5 bytes", messages(msg("user", "abcde")), true, 2},
		{"messages add up", messages(msg("system", strings.Repeat("s", 8000)), msg("user", strings.Repeat("q", 400))), true, 2100},
		{"escapes count unescaped", messages(msg("user", `\n\n\n\n\n`)), true, 2},
		{"unicode escapes count as UTF-8", messages(msg("user", `\u00e9\u00e9\ud83d\ude00`)), true, 2},
		{"parts concatenate", `[{"role":"user","content":[{"type":"text","text":"abc"},{"type":"text","text":"defgh"}]}]`, true, 2},
		{"a part without text is its JSON", `[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]`, true, 11},
		{"null content", `[{"role":"assistant","content":null,"tool_calls":[]}]`, true, 1},
		{"no content", `[{"role":"tool"}]`, true, 1},
		{"other content is its JSON", `[{"role":"user","content":12345}]`, true, 2},
		{"a message not an object is its JSON", `[{"role":"user","content":"abcd"},"abcdefg"]`, true, 4},
		{"no messages", `[]`, true, 0},
		{"text prompt", `"` + strings.Repeat("x", 10) + `"`, false, 3},
		{"text prompt array is its JSON", `["ab","cd"]`, false, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := Tokenize([]byte(tt.raw), tt.chat, 64, nil)
			if got.N != tt.tokens || len(got.Blocks) != tt.tokens/64 {
				t.Errorf("tokens, blocks = %d, %d; want %d, %d", got.N, len(got.Blocks), tt.tokens, tt.tokens/64)
			}
		})
	}
}

// Block hashes are what the demo engine has always computed: a change in
// the hashing (or in what it covers) fails here.
func TestTokenizeKnownHashes(t *testing.T) {
	for _, tt := range []struct {
		raw   string
		chat  bool
		block int
		n     int
		want  []uint64
	}{
		{messages(msg("system", "You are a helpful assistant."), msg("user", "Hello!")), true, 4,
			9, []uint64{0x72cd8c9c345c94b6, 0x2e6879d99a29bccb}},
		{`"The quick brown fox jumps over the lazy dog"`, false, 4,
			11, []uint64{0x784d3f99f429c0b0, 0xe183b029f9604d1a}},
		{`[{"role":"user","content":[{"type":"text","text":"caf\u00e9 \n"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null}]`, true, 2,
			14, []uint64{0xe41ef72d1b13ecdd, 0xaafd283eabb3e3e1, 0xe2d2cfbed8346f4a, 0x6ad019373789992e, 0x351d76cf23b32d59, 0xecef02472db0d4b4, 0x6661edda0d06296c}},
	} {
		got := Tokenize([]byte(tt.raw), tt.chat, tt.block, nil)
		if got.N != tt.n || !reflect.DeepEqual(got.Blocks, tt.want) {
			t.Errorf("Tokenize(%s, %v, %d) = %d %#x, want %d %#x", tt.raw, tt.chat, tt.block, got.N, got.Blocks, tt.n, tt.want)
		}
	}
}

// A block hash names its whole prefix, across message boundaries, roles
// included.
func TestTokenizeChainedBlocks(t *testing.T) {
	tok := func(raw string) []uint64 { return Tokenize([]byte(raw), true, 4, nil).Blocks }
	a := tok(messages(msg("user", strings.Repeat("a", 16)+strings.Repeat("c", 16))))
	b := tok(messages(msg("user", strings.Repeat("b", 16)+strings.Repeat("c", 16))))
	a2 := tok(messages(msg("user", strings.Repeat("a", 16)+strings.Repeat("d", 16))))
	if len(a) != 2 || a[1] == b[1] {
		t.Errorf("block 2 after different blocks: %x vs %x, want different", a, b)
	}
	if a[0] != a2[0] || a[1] == a2[1] {
		t.Errorf("shared first block: %x vs %x, want the first equal, the second not", a, a2)
	}
	one := tok(messages(msg("user", strings.Repeat("e", 32))))
	two := tok(messages(msg("user", strings.Repeat("e", 16)), msg("user", strings.Repeat("e", 16))))
	if len(one) != 2 || len(two) != 2 || one[0] != two[0] || one[1] == two[1] {
		t.Errorf("one message %x vs two %x: want 2 blocks each, the first equal, the second not", one, two)
	}
	user := tok(messages(msg("user", strings.Repeat("e", 16))))
	system := tok(messages(msg("system", strings.Repeat("e", 16))))
	if user[0] == system[0] {
		t.Errorf("the role does not count: %x", user)
	}
}

// How a message's bytes are fed does not matter: parts, escapes and one
// string of the same text hash the same.
func TestTokenizeSameText(t *testing.T) {
	text := "The quick brown fox\njumps over the lazy dog, café 🎉 and more text to fill blocks."
	want := Tokenize([]byte(messages(msg("user", strings.ReplaceAll(text, "\n", `\n`)))), true, 3, nil)
	for _, raw := range []string{
		messages(msg("user", `The quick brown fox\u000ajumps over the lazy dog, caf\u00e9 \ud83c\udf89 and more text to fill blocks.`)),
		`[{"content":[{"text":"The quick "},{"text":"brown fox\njumps over the lazy dog, café"},{"text":""},{"type":"text","text":" 🎉 and more text to fill blocks."}],"role":"user"}]`,
	} {
		if got := Tokenize([]byte(raw), true, 3, nil); !reflect.DeepEqual(got, want) {
			t.Errorf("Tokenize(%s) = %+v, want %+v", raw, got, want)
		}
	}
}

func TestTokenizeReusesBlocks(t *testing.T) {
	buf := make([]uint64, 5, 64)
	got := Tokenize([]byte(messages(msg("user", strings.Repeat("x", 64)))), true, 4, buf)
	if len(got.Blocks) != 4 || &got.Blocks[0] != &buf[0] {
		t.Errorf("blocks = %x (len %d), want 4 in the given array", got.Blocks, len(got.Blocks))
	}
}
