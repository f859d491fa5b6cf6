package proxy

import "testing"

func TestLastUsage(t *testing.T) {
	tests := []struct {
		name, in           string
		prompt, completion int64
		ok                 bool
	}{
		{"json body", `{"id":"1","choices":[],"usage":{"prompt_tokens":7,"total_tokens":23,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":2}}}`, 7, 16, true},
		{"sse final chunk", "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n", 5, 9, true},
		{"usage null at the end", "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\ndata: {\"usage\":null}\n\n", 5, 9, true},
		{"none", `{"choices":[{"message":{"content":"the \"usage\": {\"prompt_tokens\":3}"}}]}`, 0, 0, false},
		{"cut at the start", `prompt_tokens":5,"completion_tokens":9}}`, 0, 0, false},
		{"cut at the end", `{"usage":{"prompt_tokens":5,"completion_tokens":9`, 0, 0, false},
		{"not a count", `{"usage":{"prompt_tokens":"five"}}`, 0, 0, false},
		{"embeddings", `{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}`, 4, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, c, ok := lastUsage([]byte(tt.in))
			if p != tt.prompt || c != tt.completion || ok != tt.ok {
				t.Errorf("lastUsage = %d, %d, %v; want %d, %d, %v", p, c, ok, tt.prompt, tt.completion, tt.ok)
			}
		})
	}
}
