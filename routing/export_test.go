package routing

// Has reports whether the index holds block for target (tests compare
// Cached with a scan of it).
func (x *Index) Has(target string, block uint64) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	l := x.targets[target]
	if l == nil {
		return false
	}
	_, ok := l.at[block]
	return ok
}
