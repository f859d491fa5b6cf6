package demomodel

import "github.com/infermesh/infermesh/internal/prompt"

// promptTokens is a prompt as the engine counts it: see the package doc,
// "Prompt tokens", and internal/prompt, which applies the rule.
type promptTokens struct {
	n      int      // tokens
	blocks []uint64 // chained hashes of the full blocks, in order
}

// tokenizePrompt applies the token rule to a request's raw prompt (for
// chat the "messages" array, for text completions "prompt"). blocks is
// reused for the hashes.
func tokenizePrompt(raw []byte, chat bool, block int, blocks []uint64) promptTokens {
	t := prompt.Tokenize(raw, chat, block, blocks)
	return promptTokens{n: t.N, blocks: t.Blocks}
}
