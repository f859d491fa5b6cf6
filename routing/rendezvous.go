package routing

// Rendezvous is the highest-random-weight score of node for key: for a
// key, the node with the highest score is its affine one. Every node
// computes the same scores from the names alone, and a node that joins or
// leaves changes the winner only for the keys it wins or won.
func Rendezvous(key uint64, node string) uint64 {
	h := uint64(14695981039346656037) // FNV-1a over the name
	for i := 0; i < len(node); i++ {
		h ^= uint64(node[i])
		h *= 1099511628211
	}
	return mix(h ^ mix(key))
}

// mix is splitmix64's finalizer: every input bit moves every output bit.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
