// Package prompt reads the prompt of an OpenAI-style request body the way
// the demo inference engine (demomodel) counts it, without decoding the
// body: a router can then estimate a request's prompt tokens, know the
// hashes of the cache blocks its prefill would fill (those an engine's
// prefix cache may already hold) and derive an affinity key that keeps
// requests sharing a prefix together.
//
// # Tokens
//
// A message's content of n bytes is max(1, ceil(n/4)) tokens, token i
// being bytes [4i, 4i+4); a prompt is its messages' tokens in order. For a
// chat completion the prompt is the "messages" array: each message's
// "role" and "content", the content being a string, or the "text" members
// of an array of parts concatenated (a part without a string "text" counts
// as its raw JSON; of several "text" members the last string one counts),
// nothing when null, and its raw JSON when anything else. A message that
// is not an object is a message without a role whose content is its raw
// JSON, and so is a "messages" value that is not an array. For a text
// completion the prompt is "prompt": one message without a role, whose
// content is the string, or the raw JSON of any other value (an array of
// prompts or of token ids).
//
// # Blocks
//
// Blocks are block consecutive tokens of the prompt, across message
// boundaries; only full blocks count. A block's hash is the splitmix64
// finalizer of a 64-bit FNV-1a hash that starts with the previous block's
// hash (0 for the first) as 8 little-endian bytes and goes on with the
// bytes of the block's tokens, a message's first token being preceded by
// its role and a 0 byte. A block's hash thus names the whole prefix up to
// the block's end: two prompts with the same hash for their k-th block
// (barring collisions) have the same first k blocks.
//
// # Affinity keys
//
// Parse derives a request's affinity key from the first of these that
// applies:
//
//   - KeyCacheKey: the body's top-level "prompt_cache_key" is a non-empty
//     string (OpenAI's field for this): the key is a hash of its value.
//   - KeyUser: the top-level "user" is a non-empty string: a hash of its
//     value in another domain, so a user and a cache key of the same text
//     differ.
//   - KeyPrefix: a hash of the prompt's leading part. For a chat, that is
//     the "tools" member's raw JSON (hashed as it appears; absent when
//     null or an empty array) with the hash of the last full block that
//     ends at or before the start of the last message (the system prompt
//     and the earlier turns), among the first 32 blocks; without such a
//     block, the first full block of the prompt, if it has one. For a text
//     completion, the hash of the last full block among the first 32.
//   - KeyNone: none of the above (the prompt is too short to have a full
//     block, and a chat has no tools): Key is 0.
//
// A key is the splitmix64 finalizer of a 64-bit FNV-1a hash over its
// domain ("prompt_cache_key", "user" or "prefix") and a 0 byte, then the
// string's value, or for KeyPrefix the tools' JSON, a 0 byte and the
// block's hash, if any, as 8 little-endian bytes; 0 becomes 1, so only
// KeyNone has the key 0. As a conversation grows, its KeyPrefix key moves
// with the start of its last message until that is past the first 32
// blocks.
//
// # Strings
//
// A JSON string is read as encoding/json decodes it (invalid UTF-8 and
// lone surrogates become U+FFFD), except that a string without a backslash
// is taken as the bytes between its quotes, invalid UTF-8 included.
// Member names are compared after the same reading, exactly (case
// matters); of duplicate members the last counts, as encoding/json decodes
// them into a map.
//
// # Reading JSON
//
// The bodies must be valid JSON (jsonskip.Valid): nothing here validates
// them again. Parse and Tokenize do not allocate beyond growing the blocks
// slice they are given; ParseStd, the same with encoding/json, is the
// reference Parse is tested against. ObjectIter, ArrayIter, KeyIs and
// StringValue, the reading they are built on, serve other hot-path readers
// of request bodies too.
package prompt

import "encoding/binary"

// Tokens is a prompt as the engine counts it.
type Tokens struct {
	N      int      // prompt tokens
	Blocks []uint64 // chained hashes of the full blocks, in order (block k's hash names the whole prefix up to the end of block k)
}

// Tokenize applies the token rule (see the package doc) to a request's raw
// prompt: for a chat (chat true) the raw "messages" array, for a text
// completion the raw "prompt" value, valid JSON. block (> 0) is the
// tokens per block. The hashes are appended to blocks[:0].
func Tokenize(raw []byte, chat bool, block int, blocks []uint64) Tokens {
	t, _ := tokenize(raw, chat, block, blocks)
	return t
}

// tokenize is Tokenize that also returns the tokens before the last
// message (0 for a text completion).
func tokenize(raw []byte, chat bool, block int, blocks []uint64) (_ Tokens, lastStart int) {
	t := newTokenizer(block, blocks)
	if !chat {
		t.textPrompt(raw)
		return t.result(), 0
	}
	it, ok := NewArrayIter(raw)
	if !ok {
		t.rawMessage(raw)
		return t.result(), 0
	}
	for {
		msg, ok := it.Next()
		if !ok {
			return t.result(), lastStart
		}
		lastStart = t.n
		obj, ok := NewObjectIter(msg)
		if !ok {
			t.rawMessage(msg)
			continue
		}
		var role, content []byte
		for {
			key, val, ok := obj.Next()
			if !ok {
				break
			}
			switch {
			case KeyIs(key, "role"):
				role = nil
				if val[0] == '"' {
					role = val
				}
			case KeyIs(key, "content"):
				content = val
			}
		}
		t.message(role, content)
	}
}

// tokenizer counts tokens and hashes blocks as the bytes of messages are
// fed to it: a message is its role's bytes hashed into h, begin, its
// content's bytes by write, then end.
type tokenizer struct {
	block  int
	n      int    // complete tokens so far
	part   int    // bytes of the token being filled (0 to 3)
	wrote  bool   // the message has content bytes
	h      uint64 // FNV-1a state of the block being filled
	blocks []uint64
}

func newTokenizer(block int, blocks []uint64) tokenizer {
	return tokenizer{block: block, h: chainStart(0), blocks: blocks[:0]}
}

func (t *tokenizer) result() Tokens { return Tokens{N: t.n, Blocks: t.blocks} }

// begin ends a message's role and starts its content.
func (t *tokenizer) begin() {
	t.h = hashByte(t.h, 0)
	t.wrote = false
}

// write feeds content bytes, closing each block they fill.
func (t *tokenizer) write(p []byte) {
	if len(p) > 0 {
		t.wrote = true
	}
	for len(p) > 0 {
		left := (t.block-t.n%t.block)*4 - t.part // bytes to the block's end
		if len(p) < left {
			t.h = HashBytes(t.h, p)
			t.n += (t.part + len(p)) / 4
			t.part = (t.part + len(p)) % 4
			return
		}
		t.h = HashBytes(t.h, p[:left])
		p = p[left:]
		t.n += (t.part + left) / 4
		t.part = 0
		t.closeBlock()
	}
}

// end ends a message: a partial last token, or the one token of an empty
// content, counts.
func (t *tokenizer) end() {
	if t.part > 0 || !t.wrote {
		t.n++
		t.part = 0
		if t.n%t.block == 0 {
			t.closeBlock()
		}
	}
}

func (t *tokenizer) closeBlock() {
	sum := Mix64(t.h)
	t.blocks = append(t.blocks, sum)
	t.h = chainStart(sum)
}

// message feeds a chat message from its raw "role" (a string, or nil for
// none) and "content" (nil if absent).
func (t *tokenizer) message(role, content []byte) {
	if role != nil {
		t.h = hashString(t.h, role)
	}
	t.begin()
	switch {
	case content == nil || content[0] == 'n': // absent or null
	case content[0] == '"':
		t.writeString(content)
	case content[0] == '[':
		parts, _ := NewArrayIter(content)
		for {
			part, ok := parts.Next()
			if !ok {
				break
			}
			if text := partText(part); text != nil {
				t.writeString(text)
			} else {
				t.write(part)
			}
		}
	default:
		t.write(content)
	}
	t.end()
}

// partText returns the raw value of a content part's last string "text"
// member, or nil if it has none.
func partText(part []byte) (text []byte) {
	obj, ok := NewObjectIter(part)
	if !ok {
		return nil
	}
	for {
		key, val, ok := obj.Next()
		if !ok {
			return text
		}
		if val[0] == '"' && KeyIs(key, "text") {
			text = val
		}
	}
}

// textPrompt feeds a text completion's raw prompt: one message without a
// role whose content is the string, or raw JSON.
func (t *tokenizer) textPrompt(raw []byte) {
	t.begin()
	if len(raw) > 0 && raw[0] == '"' {
		t.writeString(raw)
	} else {
		t.write(raw)
	}
	t.end()
}

// rawMessage feeds a message without a role whose content is raw.
func (t *tokenizer) rawMessage(raw []byte) {
	t.begin()
	t.write(raw)
	t.end()
}

// writeString feeds the value of the JSON string lit.
func (t *tokenizer) writeString(lit []byte) {
	r := newStringReader(lit[1 : len(lit)-1])
	for p, ok := r.next(); ok; p, ok = r.next() {
		t.write(p)
	}
}

// FNV-1a 64-bit parameters.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// HashBytes is FNV-1a over b, started from h.
func HashBytes(h uint64, b []byte) uint64 {
	for _, c := range b {
		h = hashByte(h, c)
	}
	return h
}

func hashByte(h uint64, c byte) uint64 { return (h ^ uint64(c)) * fnvPrime }

// hashString is hashBytes over the value of the JSON string lit.
func hashString(h uint64, lit []byte) uint64 {
	r := newStringReader(lit[1 : len(lit)-1])
	for p, ok := r.next(); ok; p, ok = r.next() {
		h = HashBytes(h, p)
	}
	return h
}

// hashUint64 is hashBytes over x's 8 little-endian bytes.
func hashUint64(h, x uint64) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], x)
	return HashBytes(h, b[:])
}

// chainStart is the hash state a block starts from: the hash of the block
// before it (0 for the first).
func chainStart(prev uint64) uint64 { return hashUint64(fnvOffset, prev) }

// Mix64 is the splitmix64 finalizer: a cheap, well-distributed bijection
// (also the demo engine's and the router's).
func Mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	x ^= x >> 31
	return x
}
