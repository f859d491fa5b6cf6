// Command memhog is a tiny static test program for the provision package's
// engine tests: it allocates memory a MiB at a time, touching every page so
// the kernel has to back it, until it holds the MiB given as its only
// argument. Run in a container with a lower memory limit, it is killed by
// the kernel's OOM killer; if it ever holds it all, it says so and exits 4.
package main

import (
	"fmt"
	"os"
	"strconv"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: memhog MIB")
		os.Exit(2)
	}
	mib, err := strconv.Atoi(os.Args[1])
	if err != nil || mib < 1 {
		fmt.Fprintln(os.Stderr, "memhog: MIB must be a positive number")
		os.Exit(2)
	}
	fmt.Println("allocating", mib, "MiB")
	held := make([][]byte, 0, mib)
	for i := 0; i < mib; i++ {
		b := make([]byte, 1<<20)
		for j := 0; j < len(b); j += 4096 {
			b[j] = 1
		}
		held = append(held, b)
	}
	fmt.Println("holding", len(held), "MiB: no memory limit stopped it")
	os.Exit(4)
}
