package proxy

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infermesh/infermesh/internal/prompt"
	"github.com/infermesh/infermesh/placement"
	"github.com/infermesh/infermesh/routing"
)

// admitAll admits every node with scope full.
type admitAll struct{}

func (admitAll) IsAdmitted(string) bool { return true }
func (admitAll) MayServe(string) bool   { return true }
func (admitAll) Trusted(string) bool    { return true }

// BenchmarkResolveAndDecide is a routed request's decision as the proxy
// makes it: the candidates for the role through the peer scorer over the
// placement table (Candidates, which policy auto asks for: Resolve
// without its sorts) (a local instance
// and n-1 peers' adverts, with capacity), the gathering of what is known
// of each (load as held, this node's own in flight, the prefix index) and
// routing.Decide under policy auto. The prompt is parsed once outside the
// loop (prompt.Parse has its own benchmark).
func BenchmarkResolveAndDecide(b *testing.B) {
	for _, n := range []int{3, 64} {
		b.Run(fmt.Sprintf("cands=%d", n), func(b *testing.B) {
			tbl, err := placement.New(placement.Config{NodeID: "node-00", Admission: admitAll{}, AdvertTTL: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			if err := tbl.RegisterLocal("chat", placement.Local{Base: "http://127.0.0.1:8081", Model: "m"}); err != nil {
				b.Fatal(err)
			}
			for i := 1; i < n; i++ {
				node := fmt.Sprintf("node-%02d", i)
				tbl.AllowRemoteNode("chat", node, true)
				ad := placement.Advert{Name: placement.ServicePrefix + "chat", Node: node, API: "openai", Runtime: "vllm", Model: "m",
					Load: uint32(i % 5), Methods: placement.AdvertMethods(),
					Capacity: placement.Capacity{Slots: 4, Running: uint32(i % 4), Waiting: uint32(i % 2), CacheTokens: 1 << 16}}
				if err := tbl.IngestAdvertisement(node, ad); err != nil {
					b.Fatal(err)
				}
			}
			// As the agent composes it: the peer scorer over the table
			// (each peer's state read per candidate), a round trip per
			// peer read under a lock.
			scorer, err := NewPeerScorer(tbl, PeerScoreConfig{})
			if err != nil {
				b.Fatal(err)
			}
			var rttMu sync.Mutex
			rtts := map[string]time.Duration{}
			for i := 1; i < n; i++ {
				rtts[fmt.Sprintf("node-%02d", i)] = time.Duration(i%7) * time.Millisecond
			}
			p := &Proxy{router: newRouter(), cfg: Config{Resolver: scorer, PeerState: scorer.State,
				RTT: func(node string) time.Duration { rttMu.Lock(); defer rttMu.Unlock(); return rtts[node] }}}
			body := []byte(`{"model":"chat","messages":[{"role":"system","content":"` + strings.Repeat("You are a careful assistant. ", 300) + `"},{"role":"user","content":"hello"}]}`)
			in := prompt.Parse(body, true, blockTokens, nil)
			for i := 1; i < n; i += 4 {
				p.router.index.Record(targetKey("chat", fmt.Sprintf("node-%02d", i)), in.Tokens.Blocks, 0)
			}
			req := routing.Request{Tokens: in.Tokens.N, Key: in.Key}
			rr := &routeReq{s: &routeScratch{}, blocks: in.Tokens.Blocks, tokens: in.Tokens.N}
			cfg := RouteConfig{Params: routing.DefaultParams()}
			if c := tbl.Resolve("chat"); len(c) != n {
				b.Fatalf("Resolve: %d candidates, want %d", len(c), n)
			}
			b.ReportAllocs()
			for b.Loop() {
				cands := p.resolveForApp("chat")
				d := p.decide("chat", cfg, cands, req, rr)
				if len(d.Order) != n {
					b.Fatal("short order")
				}
			}
		})
	}
}
