package routing

import "github.com/infermesh/infermesh/internal/prompt"

// Rendezvous is the highest-random-weight score of node for key: for a
// key, the node with the highest score is its affine one. Every node
// computes the same scores from the names alone, and a node that joins or
// leaves changes the winner only for the keys it wins or won.
func Rendezvous(key uint64, node string) uint64 {
	h := uint64(14695981039346656037) // FNV-1a over the name, without a copy
	for i := 0; i < len(node); i++ {
		h ^= uint64(node[i])
		h *= 1099511628211
	}
	return prompt.Mix64(h ^ prompt.Mix64(key))
}
