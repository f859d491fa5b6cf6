// Package routing decides, per request, which candidate serves it: the
// local instance or an admitted peer, the way an inference router does and
// a load balancer does not. It is pure (no I/O, no clock of its own): the
// proxy gathers what each candidate is known to hold and asks Decide.
//
// # The estimate
//
// For every candidate, Decide estimates the time to the first token:
//
//   - queue: the requests ahead of this one at the instance, against its
//     slots: with o requests on S slots, a new one waits for o-S+1 of
//     them to end, at S per service time (the instance's recent service
//     time). o is the larger of what the instance's metrics say (running
//     plus waiting) and the in-flight load the agent counts;
//   - prefill: the prompt's tokens the candidate probably has not cached
//     (an approximate prefix index, Index) at the candidate's recent cost
//     per token;
//   - network: the measured round trip to a peer (0 for the local one).
//
// A peer whose agent recently refused the role, or that is cooled down
// after failures, is worse by Penalty; recent failures make the estimate
// worse in proportion.
//
// # The choice (PolicyAuto)
//
// The best is the lowest estimate. A candidate is within the margin of the
// best when its estimate exceeds the best by no more than Params.AbsMargin
// or is no more than Params.RelMargin times the best (SGLang's router
// leaves its cache-affine worker only when both thresholds are crossed).
// Then, in order:
//
//  1. the local instance, when it is within the margin (no hop, its cache
//     warm) and the request's key has no claim elsewhere: ReasonLocal;
//  2. the key's node, when the request has an affinity key and that node
//     is within the margin: ReasonAffinity (ReasonLocal when it is the
//     local instance). Nodes are ranked for a key by rendezvous hashing
//     (Rendezvous), so every consumer node picks the same node for the
//     same tenant without talking to the others, and a node that joins
//     or leaves moves only its own share of the keys. A Placer bounds
//     that by load: a key whose first node already has its fair share of
//     the recent requests takes the next in its order (Request.Place).
//     Without a placement, the key's peer is its plain rendezvous peer
//     and the local instance keeps a key whose prompt it holds as much
//     of as that peer does;
//  3. the best: ReasonSpill when it leaves a local instance behind,
//     ReasonLeastTTFT otherwise.
//
// When every candidate's slots are known and every one is full, the
// decision is Full: the proxy holds the request in a bounded queue and
// decides again when a slot frees (ReasonQueued). The rest of the order,
// for failover before the first byte, is by estimate.
//
// PolicyLocalFirst is the seed's strict order (the local instance, then
// peers by load, as the caller gives them); PolicyLeastLoaded orders by
// occupancy against slots, blind to the cache: a comparison and an escape
// hatch.
package routing
