package demomodel

import (
	"encoding/json"
	"strings"
	"testing"
)

var jsonValidSeeds = []string{
	``, ` `, `{}`, `[]`, `{"a":1}`, `{"a":1,}`, `{"a" 1}`, `{"a":}`, `{,}`, `[1,]`, `[,1]`, `[1 2]`,
	`"x"`, `"x`, `"\u00e9\n\"\\\/\b\f\r\t"`, `"\x"`, `"\u12"`, `"\u12G4"`, "\"a\tb\"", "\"\xff\"",
	`0`, `-0`, `01`, `-`, `1.`, `1.5`, `.5`, `1e5`, `1E+5`, `1e-`, `1e`, `-1.25e-10`, `+1`, `1.5.5`,
	`true`, `tru`, `truex`, `false`, `null`, `nul`, `nulll`, `True`,
	`{"a":[1,{"b":null}],"c":"}"}`, `{"a":[1,{"b":null}],"c":"}"`, `[[[[]]]]`, `[[[[]]]`, `1 2`, ` {} `, "\n[\t1 ,\r2 ]\n",
	strings.Repeat("[", maxNesting) + strings.Repeat("]", maxNesting),
	strings.Repeat("[", maxNesting+1) + strings.Repeat("]", maxNesting+1),
	benchChatBody,
}

func TestJSONValidMatchesEncodingJSON(t *testing.T) {
	for _, s := range jsonValidSeeds {
		if got, want := jsonValid([]byte(s)), json.Valid([]byte(s)); got != want {
			t.Errorf("jsonValid(%.60q) = %v, want %v", s, got, want)
		}
	}
}

func FuzzJSONValid(f *testing.F) {
	for _, s := range jsonValidSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if got, want := jsonValid(data), json.Valid(data); got != want {
			t.Errorf("jsonValid(%q) = %v, want %v", data, got, want)
		}
	})
}

func BenchmarkJSONValid(b *testing.B) {
	body := []byte(benchChatBody)
	b.Run("ours", func(b *testing.B) {
		for b.Loop() {
			jsonValid(body)
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		for b.Loop() {
			json.Valid(body)
		}
	})
}
