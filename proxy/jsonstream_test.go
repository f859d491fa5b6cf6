package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/infermesh/infermesh/internal/jsonskip"
)

// streamRewrite runs in through a modelStream in writes of the sizes in
// cuts (cycled; 0 is taken as 1).
func streamRewrite(t testing.TB, in, lit []byte, cuts []int) []byte {
	t.Helper()
	var out bytes.Buffer
	m := &modelStream{w: &out, lit: lit}
	for i, k := 0, 0; i < len(in); k++ {
		n := 1
		if len(cuts) > 0 {
			n = max(cuts[k%len(cuts)], 1)
		}
		n = min(n, len(in)-i)
		if w, err := m.Write(in[i : i+n]); w != n || err != nil {
			t.Fatalf("Write(%q) = %d, %v", in[i:i+n], w, err)
		}
		i += n
	}
	if m.n != int64(out.Len()) {
		t.Fatalf("counted %d bytes written, wrote %d", m.n, out.Len())
	}
	return out.Bytes()
}

// topLevelModels returns the raw values of the top-level "model" keys of
// the JSON object b (valid JSON).
func topLevelModels(b []byte) []string {
	var out []string
	i := jsonskip.WS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil
	}
	i++
	for {
		i = jsonskip.WS(b, i)
		if b[i] == '}' {
			return out
		}
		if b[i] == ',' {
			i++
			continue
		}
		ke, _ := jsonskip.String(b, i)
		key := string(b[i+1 : ke-1])
		i = jsonskip.WS(b, ke) + 1 // past ':'
		i = jsonskip.WS(b, i)
		ve, _ := jsonskip.Value(b, i)
		if key == "model" {
			out = append(out, string(b[i:ve]))
		}
		i = ve
	}
}

var modelStreamSeeds = []string{
	`{"id":"1","model":"demo","choices":[]}`,
	`{"id":"1","object":"chat.completion","created":1,"model":"demo","choices":[{"index":0,"message":{"role":"assistant","content":"a \"quoted\" \\ answer {with} [brackets]"}}],"usage":{"prompt_tokens":3,"completion_tokens":5}}`,
	`{"choices":[{"model":"inner"}],"model":"m"}`,
	`{"model":"a\\\"b","x":"\\\\"}`,
	` { "model" : "m" , "n" : -1.5e3 , "t" : true , "f" : null } `,
	`{"mod\u0065l":"not the key","model":"the key"}`,
	`{"model":42}`, `{"model":null,"x":1}`, `{"x":{"model":"nested"}}`, `{}`, `[]`, `"model"`, `123`,
	`{"model":"a","model":"b"}`, `{"model":"a","model":7}`, `{"modelx":"a","xmodel":"b","mode":"c"}`,
	`{"a":[[[{"b":"}"}]]],"model":"z"}`, `{"model":""}`,
}

// TestModelStreamMatchesRewriteModel: cut anywhere, the streamed rewrite
// gives what rewriteModel gives on the whole document.
func TestModelStreamMatchesRewriteModel(t *testing.T) {
	for _, lit := range []string{`"chat"`, `"a-much-longer-name-than-the-instance-uses"`, `"x\"y"`} {
		for _, s := range modelStreamSeeds {
			for _, cuts := range [][]int{nil, {1}, {2}, {3, 1}, {7}, {1 << 20}} {
				checkModelStream(t, []byte(s), []byte(lit), cuts)
			}
		}
	}
}

// checkModelStream holds a modelStream to rewriteModel (the buffered
// rewrite it replaces for large answers): the same bytes for every valid
// JSON document but one with two top-level model keys, which rewriteModel
// leaves alone (it cannot tell which one a client reads) and the stream
// cannot know of before the end: there every string model must be lit,
// and the document otherwise the same.
func checkModelStream(t *testing.T, in, lit []byte, cuts []int) {
	t.Helper()
	got := streamRewrite(t, in, lit, cuts)
	if !json.Valid(in) {
		return // only that it does not panic, and passes what it cannot read
	}
	if _, _, _, err := modelSpan(in); errors.Is(err, errModelDuplicate) {
		if !json.Valid(got) {
			t.Fatalf("%s (cuts %v): streamed %s, not valid JSON", in, cuts, got)
		}
		for _, v := range topLevelModels(got) {
			if v[0] == '"' && v != string(lit) {
				t.Fatalf("%s (cuts %v): streamed %s: a top-level model is %s, want %s", in, cuts, got, v, lit)
			}
		}
		return
	}
	want := rewriteModel(bytes.Clone(in), lit)
	if !bytes.Equal(got, want) {
		t.Fatalf("%s (cuts %v): streamed %s, rewriteModel %s", in, cuts, got, want)
	}
}

func FuzzModelStream(f *testing.F) {
	for _, s := range modelStreamSeeds {
		f.Add([]byte(s), "chat", []byte{1, 3})
	}
	f.Fuzz(func(t *testing.T, in []byte, model string, cuts []byte) {
		lit, err := json.Marshal(model)
		if err != nil {
			return
		}
		c := make([]int, len(cuts))
		for i, b := range cuts {
			c[i] = int(b)
		}
		checkModelStream(t, in, lit, c)
	})
}

// bigAnswer is a chat completion of about size bytes naming model.
func bigAnswer(model string, size int) []byte {
	head := `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"` + model + `","choices":[{"index":0,"message":{"role":"assistant","content":"`
	tail := `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":7}}`
	var b bytes.Buffer
	b.WriteString(head)
	for b.Len() < size-len(tail) {
		b.WriteString(`word \"quoted\" {x} `)
	}
	b.WriteString(tail)
	return b.Bytes()
}

// A pinned instance's answer too large to hold reaches the client whole
// and in order, its model rewritten to the name the client asked for,
// whether the instance declares its length or sends it chunked; a small
// one keeps its exact Content-Length.
func TestPinnedLargeAnswerIsRewrittenAsItStreams(t *testing.T) {
	answer := bigAnswer("demo", 3<<20)
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprintf("chunked=%v", chunked), func(t *testing.T) {
			e := newEnv(t, Config{})
			e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "application/json")
				if !chunked {
					w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
				}
				for b := answer; len(b) > 0; {
					n := min(len(b), 100_000)
					if _, err := w.Write(b[:n]); err != nil {
						return
					}
					b = b[n:]
					w.(http.Flusher).Flush()
				}
			}), "demo")
			resp := e.post(pathChat, `{"model":"chat","messages":[]}`)
			got, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("status %d, read %d bytes: %v", resp.StatusCode, len(got), err)
			}
			want := bytes.Replace(answer, []byte(`"model":"demo"`), []byte(`"model":"chat"`), 1)
			if !bytes.Equal(got, want) {
				t.Fatalf("got %d bytes, want %d: the answer was not passed whole with its model rewritten", len(got), len(want))
			}
			if cl := resp.Header.Get("Content-Length"); cl != "" {
				t.Errorf("Content-Length %s on an answer rewritten as it streams; the rewrite changes its length", cl)
			}
		})
	}
	t.Run("small", func(t *testing.T) {
		e := newEnv(t, Config{})
		small := bigAnswer("demo", 2<<10)
		e.upstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(small)
		}), "demo")
		resp := e.post(pathChat, `{"model":"chat","messages":[]}`)
		got, _ := io.ReadAll(resp.Body)
		if want := strings.Replace(string(small), `"demo"`, `"chat"`, 1); string(got) != want || resp.Header.Get("Content-Length") != strconv.Itoa(len(want)) {
			t.Errorf("small answer: %d bytes, Content-Length %q; want %d bytes with that length", len(got), resp.Header.Get("Content-Length"), len(want))
		}
	})
}
