package routing

import (
	"encoding/json"
	"hash/fnv"
)

// What a router reads of a request body: the prompt's estimated tokens,
// the chained hashes of its full cache blocks (for Index), and an
// affinity key.
//
// Tokens follow the demo engine's rule (a message's content of n bytes is
// max(1, ceil(n/4)) tokens); a block is BlockTokens tokens of the
// messages' contents in order, and block k's hash covers block k-1's, so
// it names the whole prefix up to its end.
//
// The affinity key is the first of: the body's "prompt_cache_key"
// (OpenAI's field for it), its "user", a hash of the prompt's leading part
// (the "tools" and every message before the last: system prompt and
// earlier turns; for a text completion, the prompt's first full blocks).
// A prompt too short to have a full leading block has none.

// BlockTokens is a block's size in tokens.
const BlockTokens = 64

// maxKeyBlocks caps the leading part the prefix key covers.
const maxKeyBlocks = 32

// KeySource says where an affinity key came from.
type KeySource string

// Key sources.
const (
	KeyNone     KeySource = "none"
	KeyCacheKey KeySource = "prompt_cache_key"
	KeyUser     KeySource = "user"
	KeyPrefix   KeySource = "prefix"
)

// Prompt is what Parse reads of a body.
type Prompt struct {
	Tokens    int
	Blocks    []uint64
	Key       uint64
	KeySource KeySource
}

type promptBody struct {
	PromptCacheKey string          `json:"prompt_cache_key"`
	User           string          `json:"user"`
	Tools          json.RawMessage `json:"tools"`
	Messages       []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	} `json:"messages"`
	Prompt json.RawMessage `json:"prompt"`
}

// ParsePrompt reads a chat completion's (chat) or a text completion's
// body. blocks is reused for Prompt.Blocks. A body it cannot read gives
// an empty Prompt (KeyNone): routing then goes by load alone.
func ParsePrompt(body []byte, chat bool, blocks []uint64) Prompt {
	p := Prompt{Blocks: blocks[:0], KeySource: KeyNone}
	var b promptBody
	if json.Unmarshal(body, &b) != nil {
		return p
	}
	c := chain{blocks: p.Blocks}
	lead := 0 // full blocks before the last message
	if chat {
		for i, m := range b.Messages {
			if i == len(b.Messages)-1 {
				lead = len(c.blocks)
			}
			c.message(m.Role, contentText(m.Content))
		}
	} else {
		c.message("", contentText(b.Prompt))
		lead = len(c.blocks)
	}
	p.Tokens, p.Blocks = c.n, c.blocks
	switch {
	case b.PromptCacheKey != "":
		p.Key, p.KeySource = keyOf("k", []byte(b.PromptCacheKey)), KeyCacheKey
	case b.User != "":
		p.Key, p.KeySource = keyOf("u", []byte(b.User)), KeyUser
	default:
		if lead == 0 && len(c.blocks) > 0 {
			lead = 1
		}
		lead = min(lead, maxKeyBlocks)
		if lead > 0 || len(b.Tools) > 0 {
			h := fnv.New64a()
			_, _ = h.Write([]byte("p"))
			_, _ = h.Write(b.Tools)
			if lead > 0 {
				var x [8]byte
				v := c.blocks[lead-1]
				for i := range x {
					x[i] = byte(v >> (8 * i))
				}
				_, _ = h.Write(x[:])
			}
			p.Key, p.KeySource = nonZero(mix(h.Sum64())), KeyPrefix
		}
	}
	return p
}

func keyOf(domain string, v []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(domain))
	_, _ = h.Write(v)
	return nonZero(mix(h.Sum64()))
}

func nonZero(k uint64) uint64 {
	if k == 0 {
		return 1
	}
	return k
}

// contentText is a message content's text: a string, an array of parts'
// "text" concatenated, else its raw JSON.
func contentText(raw json.RawMessage) []byte {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []byte(s)
	}
	var parts []struct {
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) == nil {
		var out []byte
		for _, pt := range parts {
			out = append(out, pt.Text...)
		}
		return out
	}
	return raw
}

// chain counts tokens and hashes full blocks as messages are fed to it.
type chain struct {
	n      int
	h      uint64
	blocks []uint64
}

const fnvOffset, fnvPrime = 14695981039346656037, 1099511628211

func (c *chain) bytes(b []byte) {
	if c.h == 0 {
		c.h = fnvOffset
	}
	for _, x := range b {
		c.h ^= uint64(x)
		c.h *= fnvPrime
	}
}

func (c *chain) message(role string, content []byte) {
	c.bytes([]byte(role))
	c.bytes([]byte{0})
	left := max(1, (len(content)+3)/4)
	off := 0
	for left > 0 {
		k := min(left, BlockTokens-c.n%BlockTokens)
		end := min(off+4*k, len(content))
		c.bytes(content[off:end])
		off, left, c.n = end, left-k, c.n+k
		if c.n%BlockTokens == 0 {
			sum := mix(c.h)
			c.blocks = append(c.blocks, sum)
			c.h = fnvOffset ^ sum // the next block starts from this one
		}
	}
}
