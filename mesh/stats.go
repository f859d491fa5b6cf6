package mesh

import "sync/atomic"

// GossipStats counts what this node handed memberlist to send on behalf of
// adverts, so that advert traffic can be told apart from membership
// traffic (the transport sees only encrypted packets).
type GossipStats struct {
	// AdvertBroadcastBytes is the size of the adverts piggybacked on gossip
	// packets (memberlist's per-message overhead included), summed over
	// every packet they went out in.
	AdvertBroadcastBytes uint64
	// AdvertStateBytes is the size of our advert state sent in push/pulls
	// (ours and every fresh advert we hold).
	AdvertStateBytes uint64
	// DigestsSent and DigestsReceived count membership digests (see
	// Config.AntiEntropyInterval); AntiEntropyPushPulls counts the
	// push/pulls this node started because one differed from its view.
	DigestsSent, DigestsReceived, AntiEntropyPushPulls uint64
	// AdvertDirectSends counts adverts sent in packets of their own
	// because memberlist's broadcasts left no room for them (see
	// advertgossip.go).
	AdvertDirectSends uint64
	// AdvertRounds counts the advertiser's passes over the local roles
	// (one per gossip interval, whether or not one was due): what a check
	// that something was never advertised waits past.
	AdvertRounds uint64
}

type gossipStats struct {
	advertBroadcastBytes atomic.Uint64
	advertStateBytes     atomic.Uint64
	digestsSent          atomic.Uint64
	digestsReceived      atomic.Uint64
	antiEntropyPushPulls atomic.Uint64
	advertPiggybacks     atomic.Uint64 // gossip packets memberlist took adverts into
	advertDirectSends    atomic.Uint64
	backPushPulls        atomic.Uint64 // push/pulls with a peer back alive (peerBack)
	refutes              atomic.Uint64 // suspicions or deaths of ours memberlist refuted (noteRefuted)
	advertRounds         atomic.Uint64 // advertiseOnce calls
}

// GossipStats returns the counters since New.
func (m *Mesh) GossipStats() GossipStats {
	return GossipStats{
		AdvertBroadcastBytes: m.stats.advertBroadcastBytes.Load(),
		AdvertStateBytes:     m.stats.advertStateBytes.Load(),
		DigestsSent:          m.stats.digestsSent.Load(),
		DigestsReceived:      m.stats.digestsReceived.Load(),
		AntiEntropyPushPulls: m.stats.antiEntropyPushPulls.Load(),
		AdvertDirectSends:    m.stats.advertDirectSends.Load(),
		AdvertRounds:         m.stats.advertRounds.Load(),
	}
}

// AdvertQueueLen is how many adverts wait in this node's broadcast queue
// (sent or not yet; each leaves after its retransmit limit).
func (m *Mesh) AdvertQueueLen() int { return m.bcast.NumQueued() }
