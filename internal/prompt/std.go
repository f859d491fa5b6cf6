package prompt

import (
	"bytes"
	"encoding/json"
)

// ParseStd is Parse written with encoding/json: the reference Parse is
// tested against, and an alternative for callers that prefer it. It
// allocates as encoding/json does.
func ParseStd(body []byte, chat bool, block int, blocks []uint64) Info {
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil {
		top = nil // not an object: no members
	}
	t := newTokenizer(block, blocks)
	lastStart := 0
	if raw, ok := top[promptField(chat)]; ok && raw[0] != 'n' {
		lastStart = stdTokenize(&t, raw, chat)
	}
	info := Info{Tokens: t.result()}
	var tools []byte
	if chat {
		tools = stdTools(top["tools"])
	}
	if s, ok := stdString(top["prompt_cache_key"]); ok && len(s) > 0 {
		info.Key, info.KeySource = finishKey(HashBytes(cacheKeyDomain, s)), KeyCacheKey
	} else if s, ok := stdString(top["user"]); ok && len(s) > 0 {
		info.Key, info.KeySource = finishKey(HashBytes(userDomain, s)), KeyUser
	} else {
		info.Key, info.KeySource = prefixKey(chat, tools, info.Tokens, lastStart, block)
	}
	return info
}

// stdTokenize feeds the raw prompt to t and returns the tokens before its
// last message.
func stdTokenize(t *tokenizer, raw json.RawMessage, chat bool) (lastStart int) {
	var msgs []json.RawMessage
	switch {
	case !chat:
		if s, ok := stdString(raw); ok {
			raw = s
		}
		t.rawMessage(raw)
		return 0
	case raw[0] != '[' || json.Unmarshal(raw, &msgs) != nil:
		t.rawMessage(raw)
		return 0
	}
	for _, msg := range msgs {
		lastStart = t.n
		var role, content []byte
		var fields map[string]json.RawMessage
		if msg[0] == '{' && json.Unmarshal(msg, &fields) == nil {
			role, _ = stdString(fields["role"])
			content = stdContent(fields["content"])
		} else {
			content = msg
		}
		t.h = HashBytes(t.h, role)
		t.begin()
		t.write(content)
		t.end()
	}
	return lastStart
}

// stdContent is the text of a message's raw content.
func stdContent(raw json.RawMessage) []byte {
	if s, ok := stdString(raw); ok {
		return s
	}
	var parts []json.RawMessage
	switch {
	case raw == nil || raw[0] == 'n':
		return nil
	case raw[0] != '[' || json.Unmarshal(raw, &parts) != nil:
		return raw
	}
	var text []byte
	for _, part := range parts {
		text = append(text, stdPartText(part)...)
	}
	return text
}

// stdPartText is the text of a content part: its last string "text"
// member, else its raw JSON. It reads the members in order, as a map would
// keep only the last "text" whatever its type.
func stdPartText(part json.RawMessage) []byte {
	if part[0] != '{' {
		return part
	}
	text := []byte(part)
	dec := json.NewDecoder(bytes.NewReader(part))
	if _, err := dec.Token(); err != nil { // '{'
		return part
	}
	for dec.More() {
		key, err := dec.Token()
		var val json.RawMessage
		if err != nil || dec.Decode(&val) != nil {
			return part
		}
		if s, ok := stdString(val); ok && key == "text" {
			text = s
		}
	}
	return text
}

// stdTools returns the raw "tools" value unless it is absent, null or an
// empty array.
func stdTools(raw json.RawMessage) []byte {
	var elems []json.RawMessage
	if raw == nil || raw[0] == 'n' || raw[0] == '[' && json.Unmarshal(raw, &elems) == nil && len(elems) == 0 {
		return nil
	}
	return raw
}

// stdString is the value of a JSON string (see the package doc,
// "Strings"); ok is false if raw is not one.
func stdString(raw json.RawMessage) (s []byte, ok bool) {
	if len(raw) == 0 || raw[0] != '"' {
		return nil, false
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		return raw[1 : len(raw)-1], true
	}
	var str string
	if json.Unmarshal(raw, &str) != nil {
		return nil, false
	}
	return []byte(str), true
}
