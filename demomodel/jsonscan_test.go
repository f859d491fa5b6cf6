package demomodel

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestObjIter(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []string // key=value pairs, raw
	}{
		{"empty", `{}`, nil},
		{"spaces", " \n{ \"a\" : 1 ,\t\"b\":\"x\" } ", []string{"a=1", `b="x"`}},
		{"nested", `{"m":[{"c":"}]\"{["},{"x":[1,[2]]}],"s":true,"n":null}`,
			[]string{`m=[{"c":"}]\"{["},{"x":[1,[2]]}]`, "s=true", "n=null"}},
		{"escaped key", `{"a\"b":-1.5e3,"z":{}}`, []string{`a\"b=-1.5e3`, "z={}"}},
		{"trailing backslash in string", `{"k":"\\","l":2}`, []string{`k="\\"`, "l=2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !json.Valid([]byte(tt.in)) {
				t.Fatalf("test input %q is not valid JSON", tt.in)
			}
			it, ok := newObjIter([]byte(tt.in))
			if !ok {
				t.Fatalf("newObjIter(%q) = not an object", tt.in)
			}
			var got []string
			for {
				k, v, ok := it.next()
				if !ok {
					break
				}
				got = append(got, string(k)+"="+string(v))
			}
			if strings.Join(got, "|") != strings.Join(tt.want, "|") {
				t.Errorf("members of %q = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
	for _, in := range []string{`[]`, `"x"`, `1`, ` null`} {
		if _, ok := newObjIter([]byte(in)); ok {
			t.Errorf("newObjIter(%q) = object, want not", in)
		}
	}
}

func TestKeyIs(t *testing.T) {
	tests := []struct {
		raw, name string
		want      bool
	}{
		{"model", "model", true},
		{`mod\u0065l`, "model", true},
		{`mod\"el`, "model", false},
		{"models", "model", false},
	}
	for _, tt := range tests {
		if got := keyIs([]byte(tt.raw), tt.name); got != tt.want {
			t.Errorf("keyIs(%q, %q) = %v, want %v", tt.raw, tt.name, got, tt.want)
		}
	}
}

func TestIntValue(t *testing.T) {
	tests := []struct {
		in     string
		want   int64
		wantOK bool
	}{
		{"0", 0, true},
		{"16", 16, true},
		{"-3", -3, true},
		{"16.0", 16, true},
		{"16.00", 16, true},
		{"16.5", 0, false},
		{"1e3", 0, false},
		{"-", 0, false},
		{`"16"`, 0, false},
		{"true", 0, false},
		{"99999999999999999999999", 1 << 40, true},
	}
	for _, tt := range tests {
		got, ok := intValue([]byte(tt.in))
		if ok != tt.wantOK || (ok && got != tt.want) {
			t.Errorf("intValue(%q) = %d, %v; want %d, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestStringValue(t *testing.T) {
	tests := []struct {
		in     string
		want   string
		wantOK bool
	}{
		{`"demo"`, "demo", true},
		{`""`, "", true},
		{`"a\nb\u00e9"`, "a\nb\u00e9", true},
		{`7`, "", false},
		{`null`, "", false},
		{`["demo"]`, "", false},
	}
	for _, tt := range tests {
		got, ok := stringValue([]byte(tt.in))
		if ok != tt.wantOK || string(got) != tt.want {
			t.Errorf("stringValue(%q) = %q, %v; want %q, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestAppendJSONString(t *testing.T) {
	for _, s := range []string{
		"", "demo", `quote " backslash \ slash /`, "ctl \x00\x01\x1f\x7f tab\t nl\n cr\r",
		"utf8 é 日本 🎉", "bad \xff\xfe utf8", "<html>&amp;", "\u2028\u2029",
	} {
		got := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Errorf("appendJSONString(%q) = %s: not JSON: %v", s, got, err)
			continue
		}
		var want string // what encoding/json makes of it
		m, _ := json.Marshal(s)
		if err := json.Unmarshal(m, &want); err != nil {
			t.Fatal(err)
		}
		if back != want {
			t.Errorf("appendJSONString(%q) decodes to %q, want %q", s, back, want)
		}
	}
}

func TestWordsNeedNoEscaping(t *testing.T) {
	for _, w := range words {
		if got := string(appendJSONString(nil, w)); got != `"`+w+`"` || w == "" || strings.ContainsAny(w, " \t") {
			t.Errorf("word %q needs escaping or is empty (%s)", w, got)
		}
	}
}

func TestEmbedDeterministicUnitNorm(t *testing.T) {
	for _, dim := range []int{1, 2, 16, 1000} {
		a, b := make([]float32, dim), make([]float32, dim)
		embed(a, 42)
		embed(b, 42)
		var sum float64
		for i := range a {
			if a[i] != b[i] {
				t.Fatalf("dim %d: embed not deterministic at %d", dim, i)
			}
			sum += float64(a[i]) * float64(a[i])
		}
		if sum < 1-1e-5 || sum > 1+1e-5 {
			t.Errorf("dim %d: squared norm = %v, want 1", dim, sum)
		}
	}
}
