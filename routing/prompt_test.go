package routing

import (
	"strings"
	"testing"
)

func chatBody(extra, system, last string) []byte {
	return []byte(`{"model":"m",` + extra + `"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + last + `"}]}`)
}

func TestParsePrompt(t *testing.T) {
	sys := strings.Repeat("s", 2000*4) // 2,000 tokens: 31 full blocks
	p := ParsePrompt(chatBody("", sys, strings.Repeat("q", 400)), true, nil)
	if p.Tokens != 2100 || len(p.Blocks) != 2100/BlockTokens || p.KeySource != KeyPrefix || p.Key == 0 {
		t.Fatalf("a chat with a long system prompt: tokens %d, %d blocks, key %s %x", p.Tokens, len(p.Blocks), p.KeySource, p.Key)
	}
	// Another last message: the same tenant, the same key and leading blocks.
	q := ParsePrompt(chatBody("", sys, "another question"), true, nil)
	if q.Key != p.Key || q.Blocks[30] != p.Blocks[30] {
		t.Errorf("another last message changed the prefix key or the leading blocks")
	}
	// Another system prompt: another tenant.
	if o := ParsePrompt(chatBody("", strings.Repeat("t", 8000), "x"), true, nil); o.Key == p.Key || o.Blocks[0] == p.Blocks[0] {
		t.Errorf("another system prompt kept the key or the first block")
	}
	// Tools count in the prefix.
	if w := ParsePrompt(chatBody(`"tools":[{"type":"function"}],`, sys, "x"), true, nil); w.Key == p.Key || w.KeySource != KeyPrefix {
		t.Errorf("tools did not change the prefix key")
	}
	// prompt_cache_key, then user, come first; they differ from each other.
	ck := ParsePrompt(chatBody(`"prompt_cache_key":"t1","user":"t1",`, sys, "x"), true, nil)
	us := ParsePrompt(chatBody(`"user":"t1",`, sys, "x"), true, nil)
	if ck.KeySource != KeyCacheKey || us.KeySource != KeyUser || ck.Key == us.Key || ck.Key == 0 {
		t.Errorf("keys: cache key %s %x, user %s %x", ck.KeySource, ck.Key, us.KeySource, us.Key)
	}
	// A short prompt has no leading block: no key.
	if s := ParsePrompt(chatBody("", "be brief", "hi"), true, nil); s.KeySource != KeyNone || s.Key != 0 || s.Tokens != 3 {
		t.Errorf("a short chat: %+v", s)
	}
	// A text completion.
	if c := ParsePrompt([]byte(`{"prompt":"`+sys+`"}`), false, nil); c.Tokens != 2000 || c.KeySource != KeyPrefix {
		t.Errorf("a text completion: tokens %d key %s", c.Tokens, c.KeySource)
	}
	// Content as parts counts their text.
	parts := ParsePrompt([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"text","text":"efgh"}]}]}`), true, nil)
	if parts.Tokens != 2 {
		t.Errorf("content parts: %d tokens, want 2", parts.Tokens)
	}
	// Not JSON: nothing, no panic.
	if b := ParsePrompt([]byte(`{"messages":`), true, nil); b.Tokens != 0 || b.KeySource != KeyNone {
		t.Errorf("a broken body: %+v", b)
	}
}

func FuzzParsePrompt(f *testing.F) {
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}]}`), true)
	f.Add([]byte(`{"prompt":["a","b"],"user":"u"}`), false)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		p := ParsePrompt(body, chat, nil)
		if (p.Key == 0) != (p.KeySource == KeyNone) {
			t.Fatalf("key %x with source %s", p.Key, p.KeySource)
		}
		if len(p.Blocks) != p.Tokens/BlockTokens {
			t.Fatalf("%d tokens, %d blocks", p.Tokens, len(p.Blocks))
		}
	})
}
