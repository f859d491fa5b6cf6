package mesh

import (
	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Adverts ride memberlist's gossip packets: memberlist fills each packet
// with its own broadcasts first (alive, suspect and dead messages) and
// hands the delegate what space is left. While a fleet forms, its queue
// holds an alive message of about 350 bytes for every new member, each
// retransmitted RetransmitMult x log10(N+1) times, so for tens of seconds
// the space left is smaller than an advert and adverts wait (measured: 5-14
// s for an advert to reach N=100; memberlist#299 reports the same
// starvation near 1000 nodes).
//
// So when a gossip interval passed with adverts queued and memberlist took
// none of them, the advertise loop sends them itself, in packets of their
// own to GossipNodes random members, from the same queue: they use up the
// same retransmissions, and the fallback costs a packet header per advert
// only when piggybacking failed.

// advertPacketLimit bounds the adverts sent in one fallback round to one
// member: at most one UDP packet's worth.
const advertPacketLimit = 1400

// gossipStarvedAdverts sends queued adverts in their own packets when
// memberlist took none since the last call. Called by the advertise loop
// every GossipInterval.
func (m *Mesh) gossipStarvedAdverts() {
	taken := m.stats.advertPiggybacks.Load()
	if taken != m.lastPiggybacks {
		m.lastPiggybacks = taken
		return
	}
	if m.bcast.NumQueued() == 0 {
		return
	}
	for range m.cfg.GossipNodes {
		name, addr := m.randomLive()
		if addr == "" {
			return
		}
		msgs := m.bcast.GetBroadcasts(0, advertPacketLimit)
		if len(msgs) == 0 {
			return
		}
		to := memberlist.Address{Addr: addr, Name: name}
		for _, msg := range msgs {
			if err := m.ml.SendToAddress(to, msg); err != nil {
				m.log.Debug("advert not sent", zap.String("peer", name), zap.Error(err))
				continue
			}
			m.stats.advertBroadcastBytes.Add(uint64(len(msg)))
			m.stats.advertDirectSends.Add(1)
		}
	}
}
