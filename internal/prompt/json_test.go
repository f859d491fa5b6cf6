package prompt

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestObjectIter(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want string // key=value|..., raw
	}{
		{`{}`, ""},
		{" \n{ \"a\" : 1 ,\t\"b\":\"x\" } ", `a=1|b="x"`},
		{`{"m":[{"c":"}]\"{["},{"x":[1,[2]]}],"s":true,"n":null}`, `m=[{"c":"}]\"{["},{"x":[1,[2]]}]|s=true|n=null`},
		{`{"a\"b":-1.5e3,"z":{}}`, `a\"b=-1.5e3|z={}`},
		{`{"k":"\\","l":2}`, `k="\\"|l=2`},
	} {
		it, ok := NewObjectIter([]byte(tt.in))
		if !ok {
			t.Fatalf("NewObjectIter(%q) = not an object", tt.in)
		}
		var got []string
		for {
			k, v, ok := it.Next()
			if !ok {
				break
			}
			got = append(got, string(k)+"="+string(v))
		}
		if strings.Join(got, "|") != tt.want {
			t.Errorf("members of %q = %q, want %q", tt.in, got, tt.want)
		}
	}
	for _, in := range []string{`[]`, `"x"`, `1`, ` null`} {
		if _, ok := NewObjectIter([]byte(in)); ok {
			t.Errorf("NewObjectIter(%q) = object, want not", in)
		}
	}
}

func TestArrayIter(t *testing.T) {
	for in, want := range map[string]string{
		`[]`:                        "",
		` [ 1 , "a]" ,[2,[]], {} ]`: `1|"a]"|[2,[]]|{}`,
	} {
		it, ok := NewArrayIter([]byte(in))
		if !ok {
			t.Fatalf("NewArrayIter(%q) = not an array", in)
		}
		var got []string
		for {
			v, ok := it.Next()
			if !ok {
				break
			}
			got = append(got, string(v))
		}
		if strings.Join(got, "|") != want {
			t.Errorf("elements of %q = %q, want %q", in, got, want)
		}
	}
	if _, ok := NewArrayIter([]byte(`{}`)); ok {
		t.Error("NewArrayIter({}) = array, want not")
	}
}

func TestKeyIs(t *testing.T) {
	for _, tt := range []struct {
		raw, name string
		want      bool
	}{
		{"model", "model", true},
		{`mod\u0065l`, "model", true},
		{`\u006d\u006f\u0064\u0065\u006c`, "model", true},
		{`mod\"el`, `mod"el`, true},
		{`mod\"el`, "model", false},
		{"models", "model", false},
		{`model\u0073`, "model", false},
		{`mod\u0065`, "model", false},
		{`caf\u00e9`, "café", true},
	} {
		if got := KeyIs([]byte(tt.raw), tt.name); got != tt.want {
			t.Errorf("KeyIs(%q, %q) = %v, want %v", tt.raw, tt.name, got, tt.want)
		}
	}
}

// With an escape, StringValue decodes as encoding/json does; without one
// it keeps the bytes as they are.
func TestStringValue(t *testing.T) {
	for _, in := range []string{
		`"demo"`, `""`, `"a\nb\u00e9"`, `"\"\\\/\b\f\n\r\t"`, `"\u0000\u001f\u007f"`,
		`"\ud83d\ude00 pair"`, `"\ud83d lone high"`, `"\ude00 lone low"`, `"\ud83d\u0041 high, then not low"`,
		`"\ud83d\ud83d\ude00 two highs"`, `"\uD83D\uDE00 upper hex"`, `"\uffff\ufffe"`,
		"\"\xff invalid \xe2\x82 UTF-8 \\n\"", "\"\xe2\x82\\u0041\"", "\"end \\t \xf0\x9f\x98\"",
	} {
		var want string
		if err := json.Unmarshal([]byte(in), &want); err != nil {
			t.Fatalf("test input %q: %v", in, err)
		}
		if got, ok := StringValue([]byte(in)); !ok || string(got) != want {
			t.Errorf("StringValue(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
	if got, ok := StringValue([]byte("\"raw \xff\"")); !ok || string(got) != "raw \xff" {
		t.Errorf(`StringValue("raw \xff") = %q, %v; want the bytes as they are`, got, ok)
	}
	for _, in := range []string{`7`, `null`, `["demo"]`, `{}`} {
		if got, ok := StringValue([]byte(in)); ok {
			t.Errorf("StringValue(%s) = %q, want not a string", in, got)
		}
	}
}
