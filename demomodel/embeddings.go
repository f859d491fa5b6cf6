package demomodel

import (
	"encoding/binary"
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/infermesh/infermesh/internal/jsonskip"
	"github.com/infermesh/infermesh/internal/prompt"
)

// embedInput is one input to embed: its hash seed and its token count.
type embedInput struct {
	seed   uint64
	tokens int
}

// Seeds of string inputs and token-array inputs come from distinct hash
// domains, so "1" and [1] do not collide by construction.
const tokenArrayDomain = 0x746f6b656e73 // "tokens"

// parseEmbedInput decodes "input": a string, an array of strings, an array
// of tokens, or an array of token arrays.
func parseEmbedInput(raw []byte) ([]embedInput, *apiError) {
	badInput := errInvalid("input", "input must be a string, an array of strings, an array of integers or an array of integer arrays")
	if s, ok := stringValue(raw); ok {
		return []embedInput{stringInput(s)}, nil
	}
	if raw[0] != '[' {
		return nil, badInput
	}
	var elems []json.RawMessage
	if err := json.Unmarshal(raw, &elems); err != nil {
		return nil, badInput
	}
	if len(elems) == 0 {
		return nil, errInvalid("input", "input must not be an empty array")
	}
	switch elems[0][0] {
	case '"': // array of strings
		out := make([]embedInput, len(elems))
		for i, e := range elems {
			s, ok := stringValue(e)
			if !ok {
				return nil, badInput
			}
			out[i] = stringInput(s)
		}
		return out, nil
	case '[': // array of token arrays
		out := make([]embedInput, len(elems))
		for i, e := range elems {
			var toks []int64
			if json.Unmarshal(e, &toks) != nil || len(toks) == 0 {
				return nil, badInput
			}
			out[i] = tokensInput(toks)
		}
		return out, nil
	default: // one token array
		var toks []int64
		for _, e := range elems {
			if c := e[0]; c != '-' && (c < '0' || c > '9') {
				return nil, badInput
			}
		}
		if json.Unmarshal(raw, &toks) != nil {
			return nil, badInput
		}
		return []embedInput{tokensInput(toks)}, nil
	}
}

func stringInput(s []byte) embedInput {
	return embedInput{seed: prompt.HashBytes(fnvOffset, s), tokens: estimateTokens(len(s))}
}

func tokensInput(toks []int64) embedInput {
	h := uint64(fnvOffset ^ tokenArrayDomain)
	var b [8]byte
	for _, t := range toks {
		binary.LittleEndian.PutUint64(b[:], uint64(t))
		h = prompt.HashBytes(h, b[:])
	}
	return embedInput{seed: h, tokens: len(toks)}
}

func (s *Server) serveEmbeddings(w http.ResponseWriter, r *http.Request) {
	buf := getBuf()
	defer putBuf(buf)
	body, ok := s.readRequest(w, r, buf)
	if !ok {
		return
	}
	if !jsonskip.Valid(body) {
		s.writeError(w, errBadJSON)
		return
	}
	it, ok := newObjIter(body)
	if !ok {
		s.writeError(w, errNotObject)
		return
	}
	var model, input, format []byte
	dim := s.cfg.EmbeddingDim
	for {
		key, val, ok := it.next()
		if !ok {
			break
		}
		switch {
		case keyIs(key, "input"):
			input = val
		case keyIs(key, "model"):
			model = val
		case keyIs(key, "encoding_format"):
			format = val
		case keyIs(key, "dimensions"):
			if isNull(val) {
				dim = s.cfg.EmbeddingDim
				continue
			}
			n, ok := intValue(val)
			if !ok || n < 1 || n > MaxEmbeddingDim {
				s.writeError(w, errInvalid("dimensions", "dimensions must be an integer in [1, "+strconv.Itoa(MaxEmbeddingDim)+"]"))
				return
			}
			dim = int(n)
		}
	}
	if input == nil || isNull(input) {
		s.writeError(w, errInvalid("input", "input is required"))
		return
	}
	base64Format := false
	if format != nil && !isNull(format) {
		f, _ := stringValue(format)
		switch string(f) {
		case "float":
		case "base64":
			base64Format = true
		default:
			s.writeError(w, errInvalid("encoding_format", `encoding_format must be "float" or "base64"`))
			return
		}
	}
	if !s.checkModel(w, model) {
		return
	}
	inputs, e := parseEmbedInput(input)
	if e != nil {
		s.writeError(w, e)
		return
	}

	vec := make([]float32, dim)
	var scratch []byte
	if base64Format {
		scratch = make([]byte, 0, 4*dim)
	}
	tokens := 0
	out := getBuf()
	defer putBuf(out)
	b := append((*out)[:0], `{"object":"list","data":[`...)
	for i, in := range inputs {
		tokens += in.tokens
		embed(vec, in.seed)
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"object":"embedding","index":`...)
		b = strconv.AppendInt(b, int64(i), 10)
		b = append(b, `,"embedding":`...)
		if base64Format {
			b, scratch = appendEmbeddingBase64(b, scratch, vec)
		} else {
			b = appendEmbeddingFloats(b, vec)
		}
		b = append(b, '}')
	}
	b = append(b, `],"model":`...)
	b = append(b, s.modelJSON...)
	b = append(b, `,"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(tokens), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(tokens), 10)
	b = append(b, "}}"...)
	*out = b
	s.writeJSON(w, http.StatusOK, b)
}
