package prompt

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// fuzzSeeds are realistic bodies and the corners of the rule.
var fuzzSeeds = []string{
	`{"model":"llama","messages":[{"role":"system","content":"You are a helpful assistant.\nAnswer in \"one\" line."},{"role":"user","content":"Hello, how are you today?"}],"stream":true,"max_tokens":64}`,
	`{"messages":[{"role":"user","content":[{"type":"text","text":"What is in this image?"},{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]}`,
	`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"user":"alice"}`,
	`{"prompt_cache_key":"session-\u00e9\ud83d\ude00","messages":[{"role":"user","content":"caf\u00e9 \ud800 lone \udc00 \\ \/ \b\f\n\r\t"}]}`,
	`{"prompt":"Once upon a time, there was a model that counted tokens four bytes at a time.","temperature":0}`,
	`{"prompt":["first prompt","second prompt"],"user":"bob"}`,
	`{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18]}`,
	`{"messages":"not an array","tools":null,"user":""}`,
	`{"messages":[null,1,"s",[],{},{"role":null,"content":{"text":"x"}},{"content":[{"text":"a","text":1},{"text":2,"text":"b"},"raw",{"type":"text"}]}]}`,
	`{"m\u0065ssages":[{"r\u006fle":"us\u0065r","c\u006fntent":"escaped names"}],"prompt_cache_key":7,"user":{"id":1}}`,
	`{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"the last counts"}],"tools":[],"tools":[{}]}`,
	"{\"messages\":[{\"role\":\"user\",\"content\":\"raw invalid UTF-8 \xff\xfe and \xe2\x82\"},{\"role\":\"user\",\"content\":\"with an escape \\n \xff\"}]}",
	"{\"user\":\"\xff\",\"prompt_cache_key\":\"\\u0000\"}",
	` { "messages" : [ { "role" : "user" , "content" : "spaces" } ] , "tools" : [ 1 ] } `,
	`{"messages":[{"role":"system","content":"` + strings.Repeat("system prompt ", 60) + `"},{"role":"user","content":"` + strings.Repeat("q", 300) + `"}]}`,
	`{}`,
}

// FuzzParse holds Parse to ParseStd on any JSON object.
func FuzzParse(f *testing.F) {
	for _, s := range fuzzSeeds {
		for _, block := range []uint8{1, 3, 16} {
			f.Add([]byte(s), true, block)
			f.Add([]byte(s), false, block)
		}
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool, block uint8) {
		if i := jsonskip.WS(body, 0); i == len(body) || body[i] != '{' || !json.Valid(body) {
			return
		}
		b := 1 + int(block%32)
		got := Parse(body, chat, b, nil)
		want := ParseStd(body, chat, b, nil)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("Parse(%q, %v, %d) = %+v, ParseStd %+v", body, chat, b, got, want)
		}
		if (got.Key == 0) != (got.KeySource == KeyNone) {
			t.Fatalf("Parse(%q, %v, %d) key %#x from %v", body, chat, b, got.Key, got.KeySource)
		}
	})
}
