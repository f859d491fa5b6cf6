// Package defaults fills the unset fields of a configuration from its
// defaults, so a package's fill step is one line a field:
//
//	d := DefaultConfig()
//	defaults.Positive(&c.Timeout, d.Timeout)
//	defaults.Zero(&c.Name, d.Name)
//
// Which test means "unset" is the caller's choice and is part of the
// field's documented contract: Positive where zero or negative means the
// default, Zero where only the zero value does (strings, and numbers whose
// negative values the config refuses as errors, checked apart). Every
// package fills its config's defaults through these two, not cmp.Or or a
// hand-written comparison.
package defaults

// Number is what Positive accepts: durations, counts and sizes.
type Number interface {
	~int | ~int32 | ~int64 | ~uint32 | ~uint64 | ~float64
}

// Positive sets *v to def when *v is zero or negative.
func Positive[T Number](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// Zero sets *v to def when *v is the zero value of its type.
func Zero[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}
