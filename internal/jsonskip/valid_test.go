package jsonskip

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
	`{"model":"a"}`, `{"model":1}`, `{"model":"a","model":"b"}`, `{"model":2,"model":"b"}`, `{"x":{"model":"in"}}`,
	`[{"model":"a"}]`, `"model"`, `{"mod\u0065l":"a"}`, `{"model":"a",}`, `{"model":"a"} x`, `{"model":"a\"b"}`,
}

const benchChatBody = `{"model":"demo","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say hello in five words."}],"max_tokens":16,"temperature":0}`

func TestJSONValidMatchesEncodingJSON(t *testing.T) {
	for _, s := range jsonValidSeeds {
		want := json.Valid([]byte(s))
		if got := Valid([]byte(s)); got != want {
			t.Errorf("Valid(%.60q) = %v, want %v", s, got, want)
		}
		if _, got := ValidMember([]byte(s), "model"); got != want {
			t.Errorf("ValidMember(%.60q) ok = %v, want %v", s, got, want)
		}
	}
}

func FuzzJSONValid(f *testing.F) {
	for _, s := range jsonValidSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		want := json.Valid(data)
		if got := Valid(data); got != want {
			t.Errorf("Valid(%q) = %v, want %v", data, got, want)
		}
		if _, got := ValidMember(data, "model"); got != want {
			t.Errorf("ValidMember(%q) ok = %v, want %v", data, got, want)
		}
	})
}

func BenchmarkJSONValid(b *testing.B) {
	body := []byte(benchChatBody)
	b.Run("ours", func(b *testing.B) {
		for b.Loop() {
			Valid(body)
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		for b.Loop() {
			json.Valid(body)
		}
	})
}

func TestValidMember(t *testing.T) {
	tests := []struct {
		in   string
		want string // the value found, quotes included
		err  MemberErr
	}{
		{`{"model":"a","x":1}`, `"a"`, MemberOK},
		{` { "x" : [1,{"model":"no"}], "model" : "b\"c" } `, `"b\"c"`, MemberOK},
		{`{"x":{"model":"inner"}}`, ``, MemberOK},
		{`{}`, ``, MemberOK},
		{`{"model":42}`, ``, MemberNotString},
		{`{"model":42,"model":"a"}`, ``, MemberNotString},
		{`{"model":"a","model":42}`, ``, MemberDuplicate},
		{`[{"model":"a"}]`, ``, MemberNotObject},
		{`"model"`, ``, MemberNotObject},
	}
	for _, tt := range tests {
		m, ok := ValidMember([]byte(tt.in), "model")
		if !ok {
			t.Errorf("ValidMember(%s): not valid", tt.in)
			continue
		}
		got := ""
		if m.Found {
			got = tt.in[m.Start:m.End]
		}
		if got != tt.want || m.Err != tt.err {
			t.Errorf("ValidMember(%s) = %q, err %d; want %q, err %d", tt.in, got, m.Err, tt.want, tt.err)
		}
	}
}

func BenchmarkValidMember(b *testing.B) {
	body := []byte(benchChatBody)
	for b.Loop() {
		ValidMember(body, "model")
	}
}
