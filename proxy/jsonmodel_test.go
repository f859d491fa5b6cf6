package proxy

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

func TestModelSpan(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		want  string // the literal found, "" when not found
		isErr bool
	}{
		{"simple", `{"model":"a","x":1}`, `"a"`, false},
		{"spaces", ` { "x" : [1,{"model":"no"}], "model" : "b\"c" } `, `"b\"c"`, false},
		{"nested only", `{"x":{"model":"inner"}}`, ``, false},
		{"after string with brace", `{"s":"}{\"model\":1","model":"m"}`, `"m"`, false},
		{"absent", `{"messages":[]}`, ``, false},
		{"empty object", `{}`, ``, false},
		{"not string", `{"model":42}`, ``, true},
		{"array", `[{"model":"a"}]`, ``, true},
		{"scalar", `"model"`, ``, true},
		{"duplicate", `{"model":"a","model":"b"}`, ``, true},
		{"literals", `{"a":true,"b":null,"c":-1.5e3,"model":"z"}`, `"z"`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, e, found, err := modelSpan([]byte(tt.in))
			if (err != nil) != tt.isErr {
				t.Fatalf("modelSpan(%s) err = %v, want error %v", tt.in, err, tt.isErr)
			}
			got := ""
			if found {
				got = tt.in[s:e]
			}
			if got != tt.want {
				t.Errorf("modelSpan(%s) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestPinnedBody(t *testing.T) {
	tests := []struct{ in, model, want string }{
		{`{"model":"chat","messages":[]}`, "llama-3-8b", `{"model":"llama-3-8b","messages":[]}`},
		{`{"messages":[]}`, "m", `{"model":"m","messages":[]}`},
		{`{}`, "m", `{"model":"m"}`},
		{` { } `, "m", ` {"model":"m" } `},
		{`{"model":"a-very-long-model-name","x":1}`, "s", `{"model":"s","x":1}`},
		{`{"model":"x"}`, `we"ird`, `{"model":"we\"ird"}`},
	}
	for _, tt := range tests {
		got := string(pinnedBody(nil, []byte(tt.in), tt.model))
		if got != tt.want {
			t.Errorf("pinnedBody(%s, %q) = %s, want %s", tt.in, tt.model, got, tt.want)
		}
		if !json.Valid([]byte(got)) {
			t.Errorf("pinnedBody(%s) = %s, not valid JSON", tt.in, got)
		}
	}
}

func TestRewriteModel(t *testing.T) {
	tests := []struct{ in, lit, want string }{
		{`{"id":"1","model":"demo","choices":[]}`, `"chat"`, `{"id":"1","model":"chat","choices":[]}`},
		{`{"id":"1","model":"demo"}`, `"a-much-longer-name"`, `{"id":"1","model":"a-much-longer-name"}`},
		{`{"id":"1"}`, `"chat"`, `{"id":"1"}`},
		{`not json`, `"chat"`, `not json`},
		{`{"choices":[{"model":"inner"}],"model":"m"}`, `"x"`, `{"choices":[{"model":"inner"}],"model":"x"}`},
	}
	for _, tt := range tests {
		got := string(rewriteModel([]byte(tt.in), []byte(tt.lit)))
		if got != tt.want {
			t.Errorf("rewriteModel(%s, %s) = %s, want %s", tt.in, tt.lit, got, tt.want)
		}
	}
}

func FuzzRewriteModel(f *testing.F) {
	f.Add(`{"model":"a","b":[1,2,{"c":"d"}]}`, "x")
	f.Add(`{"a":"\\\"","model":"q"}`, `y"z`)
	f.Add(`{}`, "")
	f.Fuzz(func(t *testing.T, in, model string) {
		if !json.Valid([]byte(in)) || !utf8.ValidString(model) {
			return // invalid UTF-8 model names are coerced (U+FFFD), as encoding/json does
		}
		out := pinnedBody(nil, []byte(in), model)
		var m map[string]any
		if json.Unmarshal([]byte(in), &m) != nil {
			return // not an object: returned unchanged
		}
		if _, ok := m["model"].(string); !ok && m["model"] != nil {
			return
		}
		var got map[string]any
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("pinnedBody(%s) = %s: invalid JSON: %v", in, out, err)
		}
		if got["model"] != model {
			t.Fatalf("pinnedBody(%s).model = %v, want %q", in, got["model"], model)
		}
	})
}

var bodyModelSeeds = []string{
	``, `{}`, `[]`, `"model"`, `1`, `{"model":"a","x":1}`, ` { "x" : [1,{"model":"no"}], "model" : "b\"c" } `,
	`{"x":{"model":"inner"}}`, `{"s":"}{\"model\":1","model":"m"}`, `{"model":42}`, `{"model":42,"model":"a"}`,
	`{"model":"a","model":42}`, `{"model":"a","model":"b"}`, `[{"model":"a"}]`, `{"mod\u0065l":"a"}`,
	`{"model":"a",}`, `{"model":"a"} x`, `{"model":"a"`, `{"model":"\x"}`, `{"model":"a\u00e9"}`, "{\"model\":\"a\tb\"}",
	`{"a":true,"b":null,"c":-1.5e3,"model":"z"}`, `{"model":null}`, `{"model":["a"]}`, `{"model" "a"}`,
	`{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":16}`,
}

// checkBodyModel holds readBody's one pass (jsonskip.ValidMember, then
// bodyModel) to what it replaced: encoding/json's json.Valid, then
// modelSpan. Same accept/reject, same span, same error.
func checkBodyModel(t *testing.T, data []byte) {
	t.Helper()
	m, ok := jsonskip.ValidMember(data, "model")
	if want := json.Valid(data); ok != want {
		t.Fatalf("%q: one pass valid = %v, json.Valid = %v", data, ok, want)
	}
	if !ok {
		return
	}
	s, e, found, err := bodyModel(m)
	ws, we, wfound, werr := modelSpan(data)
	if s != ws || e != we || found != wfound || err != werr {
		t.Fatalf("%q: one pass = %d,%d,%v,%v; json.Valid+modelSpan = %d,%d,%v,%v", data, s, e, found, err, ws, we, wfound, werr)
	}
}

func TestBodyModelMatchesValidThenModelSpan(t *testing.T) {
	for _, s := range bodyModelSeeds {
		checkBodyModel(t, []byte(s))
	}
}

func FuzzBodyModel(f *testing.F) {
	for _, s := range bodyModelSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(checkBodyModel)
}
