package demomodel

import "encoding/binary"

// The engine's token rule (see the package doc, "Prompt tokens"): a
// message's content of n bytes is max(1, ceil(n/4)) tokens, token i being
// bytes [4i, 4i+4); a prompt is its messages' tokens in order. The first
// token of a message also carries its role, so equal contents under
// different roles are different tokens. Blocks are CacheBlock consecutive
// tokens of the prompt, across message boundaries; only full blocks are
// cacheable, and the hash of block k covers the hash of block k-1 and
// block k's bytes, so it names the whole prefix up to the end of block k.

// promptTokens is a prompt as the engine counts it.
type promptTokens struct {
	n      int      // tokens
	blocks []uint64 // chained hashes of the full blocks, in order
}

// tokenizer counts tokens and hashes blocks as messages are fed to it.
type tokenizer struct {
	block  int
	n      int    // tokens so far
	h      uint64 // FNV-1a state of the block being filled
	blocks []uint64
}

func newTokenizer(block int, blocks []uint64) tokenizer {
	t := tokenizer{block: block, blocks: blocks[:0]}
	t.h = chainStart(0)
	return t
}

// chainStart is the hash state a block starts from: the hash of the
// block before it (0 for the first).
func chainStart(prev uint64) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], prev)
	return hashBytes(fnvOffset, b[:])
}

// message feeds one message: its role marker, then its content's tokens.
func (t *tokenizer) message(role, content []byte) {
	t.h = hashBytes(t.h, role)
	t.h = hashBytes(t.h, []byte{0})
	left := max(1, (len(content)+3)/4)
	off := 0
	for left > 0 {
		k := min(left, t.block-t.n%t.block) // tokens up to the block's end
		end := min(off+4*k, len(content))
		t.h = hashBytes(t.h, content[off:end])
		off, left, t.n = end, left-k, t.n+k
		if t.n%t.block == 0 {
			sum := mix64(t.h)
			t.blocks = append(t.blocks, sum)
			t.h = chainStart(sum)
		}
	}
}

func (t *tokenizer) result() promptTokens { return promptTokens{n: t.n, blocks: t.blocks} }

// tokenizePrompt applies the rule to a request's prompt: for chat, the raw
// "messages" array (each message's role and content: a string, or the
// concatenated "text" of an array of parts; any other content counts as
// its raw JSON); for text completions, "prompt" (a string, else its raw
// JSON) as one message without a role. blocks is reused for the hashes.
func tokenizePrompt(raw []byte, chat bool, block int, blocks []uint64) promptTokens {
	t := newTokenizer(block, blocks)
	if !chat {
		if s, ok := stringValue(raw); ok {
			t.message(nil, s)
		} else {
			t.message(nil, raw)
		}
		return t.result()
	}
	it, ok := newArrIter(raw)
	if !ok { // validated before: not reached
		t.message(nil, raw)
		return t.result()
	}
	for {
		msg, ok := it.next()
		if !ok {
			return t.result()
		}
		role, content := messageParts(msg)
		t.message(role, content)
	}
}

// messageParts returns a chat message's role and content as the token
// rule reads them.
func messageParts(msg []byte) (role, content []byte) {
	obj, ok := newObjIter(msg)
	if !ok {
		return nil, msg
	}
	for {
		key, val, ok := obj.next()
		if !ok {
			return role, content
		}
		switch {
		case keyIs(key, "role"):
			role, _ = stringValue(val)
		case keyIs(key, "content"):
			content = contentText(val)
		}
	}
}

// contentText is a message content's text: a string unescaped, an array
// of parts their "text" members concatenated (a part without one counts as
// its raw JSON), null nothing, anything else its raw JSON.
func contentText(val []byte) []byte {
	if s, ok := stringValue(val); ok {
		return s
	}
	if isNull(val) {
		return nil
	}
	parts, ok := newArrIter(val)
	if !ok {
		return val
	}
	var out []byte
	for {
		part, ok := parts.next()
		if !ok {
			return out
		}
		text := part
		if obj, ok := newObjIter(part); ok {
			for {
				key, v, ok := obj.next()
				if !ok {
					break
				}
				if keyIs(key, "text") {
					if s, ok := stringValue(v); ok {
						text = s
					}
				}
			}
		}
		out = append(out, text...)
	}
}
