package prompt

import "strconv"

// KeySource says where an affinity key came from.
type KeySource uint8

const (
	KeyNone     KeySource = iota // no key: the prompt is too short to have a leading block
	KeyCacheKey                  // the body's top-level "prompt_cache_key" string (OpenAI's field)
	KeyUser                      // the body's top-level "user" string
	KeyPrefix                    // a hash of the prompt's leading part
)

var keySourceNames = [...]string{"none", "prompt_cache_key", "user", "prefix"}

// String returns the source's name: "none", "prompt_cache_key", "user"
// or "prefix".
func (k KeySource) String() string {
	if int(k) < len(keySourceNames) {
		return keySourceNames[k]
	}
	return "KeySource(" + strconv.Itoa(int(k)) + ")"
}

// Info is what a router needs of one request body.
type Info struct {
	Tokens    Tokens
	Key       uint64 // affinity key; 0 with KeyNone
	KeySource KeySource
}

// maxPrefixBlocks caps the blocks a KeyPrefix key covers.
const maxPrefixBlocks = 32

// The hash domains of the keys: each starts from FNV-1a over its name and
// a 0 byte.
var (
	cacheKeyDomain = HashBytes(fnvOffset, []byte("prompt_cache_key\x00"))
	userDomain     = HashBytes(fnvOffset, []byte("user\x00"))
	prefixDomain   = HashBytes(fnvOffset, []byte("prefix\x00"))
)

// Parse reads a whole request body (a JSON object, already known to be
// valid JSON) of a chat completion (chat true: its prompt is "messages")
// or a text completion ("prompt"), with block (> 0) tokens per block;
// other members are skipped. A body without its prompt member (or with a
// null one) has zero Tokens. Tokens.Blocks is appended to blocks[:0]. The
// package doc says how the affinity key is chosen. Parse does not allocate
// beyond growing blocks.
func Parse(body []byte, chat bool, block int, blocks []uint64) Info {
	field := promptField(chat)
	var raw, tools, cacheKey, user []byte
	if it, ok := NewObjectIter(body); ok {
		for {
			key, val, ok := it.Next()
			if !ok {
				break
			}
			switch {
			case KeyIs(key, field):
				raw = val
			case chat && KeyIs(key, "tools"):
				tools = val
			case KeyIs(key, "prompt_cache_key"):
				cacheKey = val
			case KeyIs(key, "user"):
				user = val
			}
		}
	}
	var info Info
	lastStart := 0
	if raw == nil || raw[0] == 'n' {
		info.Tokens = Tokens{Blocks: blocks[:0]}
	} else {
		info.Tokens, lastStart = tokenize(raw, chat, block, blocks)
	}
	switch {
	case len(cacheKey) > 2 && cacheKey[0] == '"': // a string, not ""
		info.Key, info.KeySource = finishKey(hashString(cacheKeyDomain, cacheKey)), KeyCacheKey
	case len(user) > 2 && user[0] == '"':
		info.Key, info.KeySource = finishKey(hashString(userDomain, user)), KeyUser
	default:
		info.Key, info.KeySource = prefixKey(chat, usedTools(tools), info.Tokens, lastStart, block)
	}
	return info
}

func promptField(chat bool) string {
	if chat {
		return "messages"
	}
	return "prompt"
}

// usedTools returns the raw "tools" value, or nil when it is absent, null
// or an empty array.
func usedTools(tools []byte) []byte {
	if tools == nil || tools[0] == 'n' {
		return nil
	}
	if it, ok := NewArrayIter(tools); ok {
		if _, ok := it.Next(); !ok {
			return nil
		}
	}
	return tools
}

// prefixKey is the KeyPrefix key of a prompt (see the package doc) whose
// chat tools (raw, nil if none) are tools and whose last message starts
// after lastStart tokens, or KeyNone.
func prefixKey(chat bool, tools []byte, t Tokens, lastStart, block int) (uint64, KeySource) {
	n := min(len(t.Blocks), maxPrefixBlocks)
	if chat {
		n = min(n, lastStart/block)
		if n == 0 && len(t.Blocks) > 0 {
			n = 1
		}
	}
	if n == 0 && tools == nil {
		return 0, KeyNone
	}
	h := hashByte(HashBytes(prefixDomain, tools), 0)
	if n > 0 {
		h = hashUint64(h, t.Blocks[n-1])
	}
	return finishKey(h), KeyPrefix
}

// finishKey mixes a key's hash, avoiding 0 (which stands for no key).
func finishKey(h uint64) uint64 {
	if k := Mix64(h); k != 0 {
		return k
	}
	return 1
}
